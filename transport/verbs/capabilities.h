// What a device can do, decoded once into the facts swirl decides on.
//
// The remote-invalidation question deserves care. The libibverbs patch that added
// IBV_WR_SEND_WITH_INV named device_cap_flags bit 21 IBV_DEVICE_SEND_W_INV (today
// IBV_DEVICE_MEM_MGT_EXTENSIONS). Bit 21 alone is not proof: some providers advertise it and then
// fail SEND_WITH_INV at run time (bnxt_re completes it with LOC_QP_OP_ERR), and only type 2
// memory windows can be invalidated remotely. So:
//   * remote_invalidation_advertised: bit 21 and a type 2 window type are both advertised;
//   * the probe can confirm it with a self-test on a loopback QP pair (bind a type 2 window,
//     READ through it, SEND_WITH_INV its rkey, check the receive completion and that the key is
//     dead after);
//   * SelectInvalidationMode() is the one place a caller turns that into a decision. It returns
//     remote invalidation, the explicit local-invalidation fallback, or an error: nothing in
//     swirl ever sends a plain SEND where a SEND_WITH_INV was asked for.

#ifndef SWIRL_TRANSPORT_VERBS_CAPABILITIES_H_
#define SWIRL_TRANSPORT_VERBS_CAPABILITIES_H_

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/verbs/device_ops.h"
#include "transport/verbs/verbs.h"

namespace swirl::verbs {

// One field per named bit of ibv_device_attr::device_cap_flags (and the two 64-bit extras in
// ibv_device_attr_ex). DecodeDeviceCapFlags sets exactly the fields whose bits are set.
struct DeviceCapFlags {
  bool resize_max_wr = false;          // bit 0
  bool bad_pkey_cntr = false;          // bit 1
  bool bad_qkey_cntr = false;          // bit 2
  bool raw_multi = false;              // bit 3
  bool auto_path_mig = false;          // bit 4
  bool change_phy_port = false;        // bit 5
  bool ud_av_port_enforce = false;     // bit 6
  bool curr_qp_state_mod = false;      // bit 7
  bool shutdown_port = false;          // bit 8
  bool init_type = false;              // bit 9
  bool port_active_event = false;      // bit 10
  bool sys_image_guid = false;         // bit 11
  bool rc_rnr_nak_gen = false;         // bit 12
  bool srq_resize = false;             // bit 13
  bool n_notify_cq = false;            // bit 14
  bool mem_window = false;             // bit 17: memory windows (type 1)
  bool ud_ip_csum = false;             // bit 18
  bool xrc = false;                    // bit 20
  bool mem_mgt_extensions = false;     // bit 21: SEND_WITH_INV / LOCAL_INV / fast registration
  bool mem_window_type_2a = false;     // bit 23
  bool mem_window_type_2b = false;     // bit 24
  bool rc_ip_csum = false;             // bit 25
  bool raw_ip_csum = false;            // bit 26
  bool managed_flow_steering = false;  // bit 29
  bool raw_scatter_fcs = false;        // bit 34 (IBV_DEVICE_RAW_SCATTER_FCS)
  bool pci_write_end_padding = false;  // bit 36 (IBV_DEVICE_PCI_WRITE_END_PADDING)
};

struct DeviceCapFlagInfo {
  int bit;
  bool DeviceCapFlags::*field;
  const char* name;  // the IBV_DEVICE_ suffix
};

// The decoding table: every named bit, once.
const std::vector<DeviceCapFlagInfo>& DeviceCapFlagTable();

DeviceCapFlags DecodeDeviceCapFlags(uint64_t device_cap_flags);
// Names of the set fields, in bit order ("MEM_WINDOW", "MEM_MGT_EXTENSIONS", ...).
std::vector<std::string> DeviceCapFlagNames(const DeviceCapFlags& flags);

enum class SelfTest { kNotRun, kPassed, kFailed };
const char* SelfTestName(SelfTest result);

struct Capabilities {
  std::string device;
  DeviceKind kind = DeviceKind::kRdmaCore;
  uint64_t device_cap_flags = 0;  // raw, for display
  DeviceCapFlags flags;

  // Memory windows.
  bool mw_type1 = false;   // MEM_WINDOW
  bool mw_type2a = false;  // MEM_WINDOW_TYPE_2A
  bool mw_type2b = false;  // MEM_WINDOW_TYPE_2B
  // Bit 21 together with a type 2 window type: what the device claims.
  bool remote_invalidation_advertised = false;
  // The loopback self-test's verdict, if it was asked for.
  SelfTest remote_invalidation_selftest = SelfTest::kNotRun;
  std::string selftest_detail;
  // The probe was asked to confirm (ProbeOptions::confirm_remote_invalidation): then only a
  // self-test that ran and passed counts, never one that could not run (port down, no GID).
  bool remote_invalidation_confirmation_required = false;

  // Advertised, and confirmed by the self-test when that was asked for (else not refuted).
  bool remote_invalidation() const {
    if (!remote_invalidation_advertised) return false;
    return remote_invalidation_confirmation_required
               ? remote_invalidation_selftest == SelfTest::kPassed
               : remote_invalidation_selftest != SelfTest::kFailed;
  }

  // Limits.
  uint32_t max_qp = 0, max_qp_wr = 0, max_sge = 0, max_cq = 0, max_cqe = 0, max_mr = 0,
           max_mw = 0, max_pd = 0, max_srq = 0, max_srq_wr = 0, max_srq_sge = 0;
  uint32_t max_qp_rd_atom = 0, max_qp_init_rd_atom = 0;
  uint64_t max_mr_size = 0;
  uint32_t max_inline_data = 0;  // probed by creating a QP (ibv_query_device does not report it)
  bool atomics = false;          // atomic_cap != IBV_ATOMIC_NONE

  // Port (ProbeOptions::port_num).
  uint8_t port_num = 1;
  ibv_port_state port_state = IBV_PORT_NOP;
  uint8_t link_layer = IBV_LINK_LAYER_UNSPECIFIED;
  ibv_mtu active_mtu = IBV_MTU_1024;
  uint16_t lid = 0;
  ibv_gid gid{};
  int gid_index = 0;  // the entry `gid` came from (ProbeOptions::gid_index, resolved)
  bool port_active() const { return port_state == IBV_PORT_ACTIVE; }
};

// Fills the device-attribute part of Capabilities (no device access; unit-testable).
void DecodeDeviceAttributes(const ibv_device_attr_ex& attr, Capabilities* caps);

struct ProbeOptions {
  uint8_t port_num = 1;
  int gid_index = kAutoGidIndex;
  // Run the loopback SEND_WITH_INV self-test (needs an active port).
  bool confirm_remote_invalidation = false;
  absl::Duration selftest_timeout = absl::Seconds(5);
};

absl::StatusOr<Capabilities> ProbeCapabilities(const std::shared_ptr<Context>& context,
                                               const ProbeOptions& options = {});

// Runs only the self-test; OkStatus if SEND_WITH_INV invalidated a type 2 window end to end.
absl::Status RemoteInvalidationSelfTest(const std::shared_ptr<Context>& context,
                                        const ProbeOptions& options);

// Several lines, for `swirl devices`.
std::string FormatCapabilities(const Capabilities& caps);
std::string FormatGid(const ibv_gid& gid);
const char* LinkLayerName(uint8_t link_layer);
const char* PortStateName(ibv_port_state state);

// ---- The decision -----------------------------------------------------------------------------

enum class InvalidationMode {
  kRemote,  // the peer's last message is SEND_WITH_INV carrying the window's rkey
  kLocal,   // explicit fallback: plain acknowledgement, then IBV_WR_LOCAL_INV by the exposer
};
const char* InvalidationModeName(InvalidationMode mode);

enum class InvalidationPolicy {
  kRequireRemote,       // refuse anything weaker
  kAllowLocalFallback,  // remote if both sides can, else the counted local fallback
};

// `local_capable`/`peer_capable`: each side's Capabilities::remote_invalidation(), the peer's as
// it declared it in the handshake. Returns the mode to use, or FailedPrecondition explaining
// which side lacks what when the policy forbids the fallback.
absl::StatusOr<InvalidationMode> SelectInvalidationMode(bool local_capable, bool peer_capable,
                                                        InvalidationPolicy policy);

}  // namespace swirl::verbs

#endif  // SWIRL_TRANSPORT_VERBS_CAPABILITIES_H_
