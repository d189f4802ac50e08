// swirl's soft device: a userspace RDMA device with RC verbs semantics, for machines without
// RDMA hardware. It hands out ordinary libibverbs objects, so code written against verbs runs on
// it unchanged; QPs in different processes on one host talk through shared memory, and with
// SWIRL_SOFT_TCP=<IPv4>[:port] set (in both processes), through TCP, across hosts.
//
// Names: "soft0", "soft1", ... Each name is one device (one GID, one memory-key space) per
// process; opening the same name twice gives two contexts on that device, as with a real HCA.
//
// Progress: a real NIC moves data on its own; the soft device moves it when the application
// calls into it (poll_cq, post_send, ...). Each device also runs one thread that takes over
// for CQs nobody is polling: a CQ armed with ibv_req_notify_cq, or one not polled for 10 ms (a
// passive target of RDMA reads and writes), and makes one round of progress for every QP when a
// peer's request to one of them stalls. SWIRL_SOFT_PROGRESS=off disables that help: a QP then
// moves only when its owner calls into the device.
//
// Environment: SWIRL_SOFT_RING_KB (size of each of a QP's two rings, default 1024, at least
// 128),
// SWIRL_SOFT_PROGRESS, SWIRL_SOFT_TCP (the TCP fabric: every soft device of the process
// listens on that address, one of this host's, on a free port, or with a port given, softN on
// that port + N; its GID is ::ffff:<IPv4> with the port in bytes 8-9; a malformed value or a
// port in use fails the open), SWIRL_SOFT_TCP_CRYPT (off: TCP records of keyed links travel
// unsealed, for benchmarks; logged as a warning), SWIRL_SOFT_TRUSTED_UIDS (users besides our own
// whose processes may link to ours over shared memory, comma-separated uids).
// The wire format between processes is in docs/SOFT_WIRE.md.

#ifndef SWIRL_TRANSPORT_SOFT_SOFT_DEVICE_H_
#define SWIRL_TRANSPORT_SOFT_SOFT_DEVICE_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "transport/verbs/device_ops.h"

namespace swirl::soft {

inline constexpr char kDefaultSoftDeviceName[] = "soft0";

// True for "soft" followed by one to four decimal digits (soft0 .. soft9999).
bool IsSoftDeviceName(absl::string_view name);

// True for a GID of a soft device on the TCP fabric: ::ffff:<IPv4> with the port in bytes 8-9
// (zero in bytes 0-7). Shared-memory soft devices have fe80::/64 GIDs; the two cannot link.
bool IsTcpFabricGid(const ibv_gid& gid);

// Opens a context on the named soft device (created on first open in this process).
absl::StatusOr<std::unique_ptr<verbs::DeviceOps>> OpenSoftDevice(absl::string_view name);

// The soft device's vendor id, as ibv_query_device reports it: a locally administered
// identifier (the IEEE U/L bit of its first octet set), which the IEEE never assigns, so no
// program takes soft0 for some vendor's hardware; nonzero, as verbs programs expect.
inline constexpr uint32_t kSoftVendorId = 0x5a5357;
inline constexpr uint32_t kSoftVendorPartId = 1;

// An ibv_device describing soft device `name`, in a zeroed block as large as libibverbs' own
// device structure and then some (4 KiB), so that provider probes that read past ibv_device
// (mlx5dv_is_supported reads the provider's ops pointer) read zeros, not another allocation.
// Free with FreeSoftDeviceBlock.
ibv_device* NewSoftDeviceBlock(absl::string_view name);
void FreeSoftDeviceBlock(ibv_device* device);

// As OpenSoftDevice, with `device` (from NewSoftDeviceBlock, kept alive by the caller past the
// context) as the context's device: the LD_PRELOAD interposer (transport/soft_verbs) opens the
// device a program found in ibv_get_device_list, and programs compare the two.
absl::StatusOr<std::unique_ptr<verbs::DeviceOps>> OpenSoftDeviceAs(absl::string_view name,
                                                                   ibv_device* device);

// ---- Beyond RoCE: soft-device extensions. Each takes any libibverbs object and is a clear
// no-op on another device's: it returns Unimplemented, which a caller that also runs on NICs
// treats as "this device does not do it" (a NIC's RC link and windows are as RoCE makes them).

// Parses a SWIRL_SOFT_TRUSTED_UIDS value ("1000,1001"; empty: none): false if malformed (the
// device then trusts no other user, and says so).
bool ParseTrustedUids(const char* text, std::vector<uid_t>* uids);

// True if `qp` belongs to a soft device (of this library or the interposer's).
bool IsSoftQp(const ibv_qp* qp);

// Binds `qp`'s link to whoever knows `key` (32 random bytes, the same on both QPs of the pair,
// handed over by the control plane, e.g. over TLS). Set it in RESET or INIT, before RTR
// (FailedPrecondition after); an empty key removes it. With a key, the QP links only with a
// peer that proves it knows the key for a nonce the QP has just drawn, on either fabric, and
// proves it back (a replayed hello fails); on the TCP fabric the link's records are also
// sealed with AES-256-GCM under keys derived from it (SWIRL_SOFT_TCP_CRYPT=off: not). A QP
// with a key refuses a peer without one and the other way round. A QP without a key links as
// before: unauthenticated, as a RoCE QP is (anyone who knows the GIDs and QPNs, which the
// control plane carries, can take the link). docs/SOFT_WIRE.md, "Link keys".
// Unimplemented for a QP of another device; InvalidArgument for a key of another size.
absl::Status SetLinkKey(ibv_qp* qp, absl::Span<const uint8_t> key);

// A memory window's lease: from `deadline` on, the responder itself refuses every remote access
// through `mw` (REM_ACCESS_ERR at the requester), whatever the application still has to do to
// revoke it. absl::InfiniteFuture() removes it. It belongs to the window, so it holds for the
// window's next binds too until changed (set it before posting the bind it is for).
// Unimplemented for a window of another device.
absl::Status SetWindowDeadline(ibv_mw* mw, absl::Time deadline);

// An rkey for the next bind of type 2 window `mw` in a slot of the key table drawn at random
// and reserved for it: post the bind (IBV_WR_BIND_MW) with this rkey and the window moves
// there, so its rkeys differ in about 31 random bits from bind to bind, where ibv_inc_rkey
// varies only the 8 of the key byte. A bind with an rkey of the window's current slot (the
// one its last bind used, or mw->rkey's until it moved: ibv_inc_rkey) binds in place, as on any
// device; mw->rkey never changes. One reservation at a time (a new call replaces it). The slot
// left is freed once nothing is bound in it. Unimplemented for another device's window (use
// ibv_inc_rkey there), InvalidArgument for a type 1 window, ResourceExhausted if no slot is free.
absl::StatusOr<uint32_t> FreshWindowRkey(ibv_mw* mw);

}  // namespace swirl::soft

#endif  // SWIRL_TRANSPORT_SOFT_SOFT_DEVICE_H_
