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
// whose processes may link to ours over shared memory, comma-separated uids), SWIRL_SOFT_FAULTS
// (injected faults, below; a malformed value fails the open).
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

// The context of the object (QP, CQ or SRQ) an asynchronous event names, on any device; null
// for port and device events, which name none.
ibv_context* AsyncEventContext(const ibv_async_event& event);

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
// ---- Injected faults (for tests; docs/SOFT_WIRE.md, "Injected faults") ----------------------
//
// What a link or a peer's device does to an RC connection in production, on demand: a link
// that fails or goes silent, a peer that stalls, a QP that dies, acknowledgements that stop, a
// frame that arrives corrupted. Off unless asked for, by the test API below or by
// SWIRL_SOFT_FAULTS in the environment (read when the process first opens a soft device):
//
//   SWIRL_SOFT_FAULTS="RULE[;RULE...]", RULE = "qp=<QPN|#K|*>,at_frame=<N>,action=<ACTION>"
//     qp        a QP number (decimal or 0x hex), #K: the K-th QP the process creates (from 1),
//               or * (every QP); default *
//     at_frame  as FaultSpec::at_frame; default 0
//     action    drop | fail | stall:<ms> | err | noack | corrupt
//   (SWIRL_SOFT_FAULTS=none arms the process, below, without any fault.)
//
// A QP with faults armed takes the device's general paths, and runs RC's transport timer at
// every progress. Every other QP runs the same timer from its polls (docs/SOFT_WIRE.md, "The
// transport timer"): a request the peer has not answered, with nothing from the peer moving for
// it, within the QP's ACK timeout x (retry_cnt + 1) fails with IBV_WC_RETRY_EXC_ERR and the QP
// enters ERR, as a NIC's retries end; ACK timeout 0 means no timer (a test's puppet peer, driven
// by hand, connects so). A receiver-not-ready wait longer than that timeout also ends so: the
// soft responder waits for a receive where a NIC would send RNR NAKs, which the requester could
// tell from silence.
// Costs nothing when off: a QP of a process without faults takes none of these paths.
struct FaultSpec {
  enum class Action {
    // From the fault on, the link carries nothing either way (frames, acknowledgements,
    // consumer indices), as a cut cable: each side's outstanding requests fail with
    // RETRY_EXC_ERR at its ACK timeout, and nothing else tells either side.
    kDrop,
    // The link fails, and both ends see it (a reset connection): each side's outstanding
    // requests, and its next one, fail with RETRY_EXC_ERR; a side with none stays in RTS.
    kFail,
    // The QP stalls for `stall_ms`: it reads, writes and acknowledges nothing, then goes on as
    // if nothing happened; everything completes late and correctly (unless the peer's ACK
    // timeout ran out first).
    kStall,
    // The QP enters ERR as after a local catastrophic error: IBV_EVENT_QP_FATAL, its work
    // requests flush; the peer's outstanding requests then fail with RETRY_EXC_ERR.
    kErr,
    // The QP stops acknowledging: its responder executes, consumes and acknowledges nothing
    // more (its own requests still go out and complete); the peer's requests fail with
    // RETRY_EXC_ERR at the peer's ACK timeout.
    kNoAck,
    // One frame arrives corrupted (a header byte the receiver must refuse: an undefined flag
    // bit): the receiver fails the connection as for any malformed frame (a responder: protocol
    // error, and the requester's request fails with RETRY_EXC_ERR; a requester reading a
    // corrupted response: IBV_WC_BAD_RESP_ERR). One-shot.
    kCorrupt,
  };
  Action action = Action::kFail;
  // When the fault fires: at the QP's N-th outgoing frame from now (requests and responses
  // alike, PAD frames aside; 1 is the next one), that frame included (dropped, held back,
  // corrupted); 0: at once, at the QP's next progress once it is linked (kCorrupt: its next
  // frame).
  uint32_t at_frame = 0;
  uint32_t stall_ms = 0;  // kStall
};

// A SWIRL_SOFT_FAULTS rule.
struct FaultRule {
  enum class Match { kAny, kQpNum, kOrdinal };
  Match match = Match::kAny;
  uint32_t value = 0;  // the QPN, or K of #K
  FaultSpec spec;
};
// Parses SWIRL_SOFT_FAULTS' syntax (above); InvalidArgument saying what is wrong.
absl::StatusOr<std::vector<FaultRule>> ParseFaultRules(absl::string_view text);

// Arms `spec` on `qp` (a soft device's RC QP, in any state; it fires once linked), replacing
// any fault armed on it before, and arms the process (the transport timer above). The fault
// stays with the QP until it fires (kStall: until the stall ends; kDrop and kNoAck: for the
// QP's life, or until it is reset).
absl::Status InjectFault(ibv_qp* qp, const FaultSpec& spec);

}  // namespace swirl::soft

#endif  // SWIRL_TRANSPORT_SOFT_SOFT_DEVICE_H_
