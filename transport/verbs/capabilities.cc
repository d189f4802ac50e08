#include "transport/verbs/capabilities.h"

#include <arpa/inet.h>

#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "transport/verbs/status.h"

namespace swirl::verbs {

const std::vector<DeviceCapFlagInfo>& DeviceCapFlagTable() {
  static const std::vector<DeviceCapFlagInfo>* table = new std::vector<DeviceCapFlagInfo>{
      {0, &DeviceCapFlags::resize_max_wr, "RESIZE_MAX_WR"},
      {1, &DeviceCapFlags::bad_pkey_cntr, "BAD_PKEY_CNTR"},
      {2, &DeviceCapFlags::bad_qkey_cntr, "BAD_QKEY_CNTR"},
      {3, &DeviceCapFlags::raw_multi, "RAW_MULTI"},
      {4, &DeviceCapFlags::auto_path_mig, "AUTO_PATH_MIG"},
      {5, &DeviceCapFlags::change_phy_port, "CHANGE_PHY_PORT"},
      {6, &DeviceCapFlags::ud_av_port_enforce, "UD_AV_PORT_ENFORCE"},
      {7, &DeviceCapFlags::curr_qp_state_mod, "CURR_QP_STATE_MOD"},
      {8, &DeviceCapFlags::shutdown_port, "SHUTDOWN_PORT"},
      {9, &DeviceCapFlags::init_type, "INIT_TYPE"},
      {10, &DeviceCapFlags::port_active_event, "PORT_ACTIVE_EVENT"},
      {11, &DeviceCapFlags::sys_image_guid, "SYS_IMAGE_GUID"},
      {12, &DeviceCapFlags::rc_rnr_nak_gen, "RC_RNR_NAK_GEN"},
      {13, &DeviceCapFlags::srq_resize, "SRQ_RESIZE"},
      {14, &DeviceCapFlags::n_notify_cq, "N_NOTIFY_CQ"},
      {17, &DeviceCapFlags::mem_window, "MEM_WINDOW"},
      {18, &DeviceCapFlags::ud_ip_csum, "UD_IP_CSUM"},
      {20, &DeviceCapFlags::xrc, "XRC"},
      {21, &DeviceCapFlags::mem_mgt_extensions, "MEM_MGT_EXTENSIONS"},
      {23, &DeviceCapFlags::mem_window_type_2a, "MEM_WINDOW_TYPE_2A"},
      {24, &DeviceCapFlags::mem_window_type_2b, "MEM_WINDOW_TYPE_2B"},
      {25, &DeviceCapFlags::rc_ip_csum, "RC_IP_CSUM"},
      {26, &DeviceCapFlags::raw_ip_csum, "RAW_IP_CSUM"},
      {29, &DeviceCapFlags::managed_flow_steering, "MANAGED_FLOW_STEERING"},
      {34, &DeviceCapFlags::raw_scatter_fcs, "RAW_SCATTER_FCS"},
      {36, &DeviceCapFlags::pci_write_end_padding, "PCI_WRITE_END_PADDING"},
  };
  return *table;
}

DeviceCapFlags DecodeDeviceCapFlags(uint64_t device_cap_flags) {
  DeviceCapFlags flags;
  for (const DeviceCapFlagInfo& info : DeviceCapFlagTable()) {
    flags.*info.field = (device_cap_flags >> info.bit) & 1;
  }
  return flags;
}

std::vector<std::string> DeviceCapFlagNames(const DeviceCapFlags& flags) {
  std::vector<std::string> names;
  for (const DeviceCapFlagInfo& info : DeviceCapFlagTable()) {
    if (flags.*info.field) names.emplace_back(info.name);
  }
  return names;
}

const char* SelfTestName(SelfTest result) {
  switch (result) {
    case SelfTest::kNotRun: return "not run";
    case SelfTest::kPassed: return "passed";
    case SelfTest::kFailed: return "FAILED";
  }
  return "?";
}

void DecodeDeviceAttributes(const ibv_device_attr_ex& attr, Capabilities* caps) {
  const ibv_device_attr& a = attr.orig_attr;
  // The 32-bit device_cap_flags and the 64-bit extension carry the same low bits.
  caps->device_cap_flags = static_cast<uint32_t>(a.device_cap_flags) | attr.device_cap_flags_ex;
  caps->flags = DecodeDeviceCapFlags(caps->device_cap_flags);
  caps->mw_type1 = caps->flags.mem_window;
  caps->mw_type2a = caps->flags.mem_window_type_2a;
  caps->mw_type2b = caps->flags.mem_window_type_2b;
  caps->remote_invalidation_advertised =
      caps->flags.mem_mgt_extensions && (caps->mw_type2a || caps->mw_type2b) && a.max_mw > 0;
  caps->max_qp = a.max_qp;
  caps->max_qp_wr = a.max_qp_wr;
  caps->max_sge = a.max_sge;
  caps->max_cq = a.max_cq;
  caps->max_cqe = a.max_cqe;
  caps->max_mr = a.max_mr;
  caps->max_mw = a.max_mw;
  caps->max_pd = a.max_pd;
  caps->max_srq = a.max_srq;
  caps->max_srq_wr = a.max_srq_wr;
  caps->max_srq_sge = a.max_srq_sge;
  caps->max_qp_rd_atom = a.max_qp_rd_atom;
  caps->max_qp_init_rd_atom = a.max_qp_init_rd_atom;
  caps->max_mr_size = a.max_mr_size;
  caps->atomics = a.atomic_cap != IBV_ATOMIC_NONE;
}

namespace {

// ibv_query_device does not report the inline limit; ask for decreasing amounts until the device
// accepts one, then keep what it granted.
uint32_t ProbeMaxInline(const std::shared_ptr<ProtectionDomain>& pd,
                        const std::shared_ptr<CompletionQueue>& cq) {
  for (uint32_t want : {1024u, 512u, 256u, 220u, 128u, 64u, 32u, 0u}) {
    QueuePairConfig config;
    config.send_cq = cq;
    config.recv_cq = cq;
    config.max_send_wr = 1;
    config.max_recv_wr = 1;
    config.max_inline_data = want;
    absl::StatusOr<std::unique_ptr<QueuePair>> qp = QueuePair::Create(pd, config);
    if (qp.ok()) return (*qp)->cap().max_inline_data;
  }
  return 0;
}

// Waits for the completion of `wr_id`; completions for other work requests polled meanwhile are
// kept in `stash` for a later call.
absl::Status WaitCompletion(CompletionQueue& cq, uint64_t wr_id, absl::Duration timeout,
                            std::vector<ibv_wc>& stash, ibv_wc* out) {
  for (size_t i = 0; i < stash.size(); ++i) {
    if (stash[i].wr_id == wr_id) {
      *out = stash[i];
      stash.erase(stash.begin() + i);
      return absl::OkStatus();
    }
  }
  absl::Time deadline = absl::Now() + timeout;
  ibv_wc wc[4];
  while (absl::Now() < deadline) {
    int n = cq.Poll(4, wc);
    if (n < 0) return absl::InternalError("ibv_poll_cq failed");
    for (int i = 0; i < n; ++i) {
      if (wc[i].wr_id == wr_id) {
        *out = wc[i];
        for (int j = i + 1; j < n; ++j) stash.push_back(wc[j]);
        return absl::OkStatus();
      }
      stash.push_back(wc[i]);
    }
  }
  return absl::DeadlineExceededError(absl::StrCat("no completion for step ", wr_id));
}

}  // namespace

absl::Status RemoteInvalidationSelfTest(const std::shared_ptr<Context>& context,
                                        const ProbeOptions& options) {
  auto pd = ProtectionDomain::Create(context);
  if (!pd.ok()) return pd.status();
  auto cq = CompletionQueue::Create(context, 16);
  if (!cq.ok()) return cq.status();
  QueuePairConfig config;
  config.send_cq = *cq;
  config.recv_cq = *cq;
  config.max_send_wr = 4;
  config.max_recv_wr = 4;
  auto requester = QueuePair::Create(*pd, config);
  if (!requester.ok()) return requester.status();
  auto responder = QueuePair::Create(*pd, config);
  if (!responder.ok()) return responder.status();

  ConnectOptions connect;
  connect.port_num = options.port_num;
  connect.gid_index = options.gid_index;
  connect.access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
  connect.rnr_retry = 0;
  // The transport timeout bounds how long the pair may take to link up, not only lost packets:
  // the soft device fails a send that finds no link within timeout x (retry_cnt + 1). The old
  // 4 ms x 2 failed whenever the machine was loaded (always under valgrind), so a server
  // probed "no remote invalidation" by chance and fell back to LOCAL_INV; so did ~270 ms x 8
  // under valgrind (2 of 4 runs of tools/devices). ~2.1 s x 8 leaves WaitCompletion's
  // selftest_timeout (5 s) to decide.
  connect.retry_cnt = 7;
  connect.timeout = 19;
  auto requester_addr = (*requester)->LocalAddress(0x1000, connect);
  if (!requester_addr.ok()) return requester_addr.status();
  auto responder_addr = (*responder)->LocalAddress(0x2000, connect);
  if (!responder_addr.ok()) return responder_addr.status();
  if (auto s = (*requester)->Connect(*responder_addr, 0x1000, connect); !s.ok()) return s;
  if (auto s = (*responder)->Connect(*requester_addr, 0x2000, connect); !s.ok()) return s;

  // The exposed buffer, its MR (MW_BIND), a type 2 window over it, and a receive buffer.
  alignas(64) char exposed[64] = {};
  alignas(64) char landing[64] = {};
  alignas(64) char recv_buf[64] = {};
  auto exposed_mr = MemoryRegion::Register(
      *pd, exposed, sizeof(exposed),
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_MW_BIND);
  if (!exposed_mr.ok()) return exposed_mr.status();
  auto landing_mr = MemoryRegion::Register(*pd, landing, sizeof(landing), IBV_ACCESS_LOCAL_WRITE);
  if (!landing_mr.ok()) return landing_mr.status();
  auto recv_mr = MemoryRegion::Register(*pd, recv_buf, sizeof(recv_buf), IBV_ACCESS_LOCAL_WRITE);
  if (!recv_mr.ok()) return recv_mr.status();
  auto mw = MemoryWindow::Allocate(*pd, IBV_MW_TYPE_2);
  if (!mw.ok()) return mw.status();

  // Step 1: bind the window through the responder's send queue (type 2: bound to that QP).
  const uint32_t rkey = ibv_inc_rkey((*mw)->rkey());
  ibv_send_wr bind{};
  ibv_send_wr* bad = nullptr;
  bind.wr_id = 1;
  bind.opcode = IBV_WR_BIND_MW;
  bind.send_flags = IBV_SEND_SIGNALED;
  bind.bind_mw.mw = (*mw)->get();
  bind.bind_mw.rkey = rkey;
  bind.bind_mw.bind_info.mr = (*exposed_mr)->get();
  bind.bind_mw.bind_info.addr = reinterpret_cast<uint64_t>(exposed);
  bind.bind_mw.bind_info.length = sizeof(exposed);
  bind.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ;
  if (int err = ibv_post_send((*responder)->get(), &bind, &bad); err != 0) {
    return VerbsError("ibv_post_send(BIND_MW)", err);
  }
  ibv_wc wc;
  std::vector<ibv_wc> stash;
  if (auto s = WaitCompletion(**cq, 1, options.selftest_timeout, stash, &wc); !s.ok()) return s;
  if (wc.status != IBV_WC_SUCCESS) return WorkCompletionError(wc);

  // Step 1b: the window works: an RDMA READ through it brings the exposed bytes. (Without
  // this, a window that never worked would pass step 3 below as well.)
  // An RDMA READ of `exposed` through the window into `landing`, waited for.
  auto read_through_window = [&](uint64_t wr_id) -> absl::Status {
    ibv_sge sge{reinterpret_cast<uint64_t>(landing), sizeof(landing), (*landing_mr)->lkey()};
    ibv_send_wr read{};
    read.wr_id = wr_id;
    read.opcode = IBV_WR_RDMA_READ;
    read.send_flags = IBV_SEND_SIGNALED;
    read.sg_list = &sge;
    read.num_sge = 1;
    read.wr.rdma.remote_addr = reinterpret_cast<uint64_t>(exposed);
    read.wr.rdma.rkey = rkey;
    if (int err = ibv_post_send((*requester)->get(), &read, &bad); err != 0) {
      return VerbsError("ibv_post_send(RDMA_READ)", err);
    }
    return WaitCompletion(**cq, wr_id, options.selftest_timeout, stash, &wc);
  };
  for (size_t i = 0; i < sizeof(exposed); ++i) exposed[i] = static_cast<char>(0x40 + i);
  {
    if (auto s = read_through_window(5); !s.ok()) return s;
    if (wc.status != IBV_WC_SUCCESS) {
      return absl::FailedPreconditionError(absl::StrCat(
          "RDMA_READ through the bound type 2 window completed with '", WcStatusName(wc.status),
          "': the window does not work"));
    }
    if (std::memcmp(landing, exposed, sizeof(exposed)) != 0) {
      return absl::FailedPreconditionError("RDMA_READ through the window brought other bytes");
    }
    std::memset(landing, 0, sizeof(landing));
  }

  // Step 2: the requester sends SEND_WITH_INV carrying that rkey.
  ibv_sge recv_sge{reinterpret_cast<uint64_t>(recv_buf), sizeof(recv_buf), (*recv_mr)->lkey()};
  ibv_recv_wr recv{};
  ibv_recv_wr* bad_recv = nullptr;
  recv.wr_id = 2;
  recv.sg_list = &recv_sge;
  recv.num_sge = 1;
  if (int err = ibv_post_recv((*responder)->get(), &recv, &bad_recv); err != 0) {
    return VerbsError("ibv_post_recv", err);
  }
  ibv_send_wr send{};
  send.wr_id = 3;
  send.opcode = IBV_WR_SEND_WITH_INV;
  send.send_flags = IBV_SEND_SIGNALED;
  send.invalidate_rkey = rkey;
  if (int err = ibv_post_send((*requester)->get(), &send, &bad); err != 0) {
    return VerbsError("ibv_post_send(SEND_WITH_INV)", err);
  }
  if (auto s = WaitCompletion(**cq, 3, options.selftest_timeout, stash, &wc); !s.ok()) return s;
  if (wc.status != IBV_WC_SUCCESS) return WorkCompletionError(wc);
  if (auto s = WaitCompletion(**cq, 2, options.selftest_timeout, stash, &wc); !s.ok()) return s;
  if (wc.status != IBV_WC_SUCCESS) return WorkCompletionError(wc);
  if (!(wc.wc_flags & IBV_WC_WITH_INV)) {
    if ((wc.wc_flags & IBV_WC_IP_CSUM_OK) && wc.invalidated_rkey == rkey) {
      // The kernel's rxe hands its IB_WC_WITH_INVALIDATE (1 << 2) to userspace unconverted,
      // where that bit reads as IBV_WC_IP_CSUM_OK. The window may well be revoked, but the data
      // path cannot tell a SEND_WITH_INV from a plain SEND on such a device, so it is refused.
      return absl::FailedPreconditionError(absl::StrFormat(
          "receive completion has IBV_WC_IP_CSUM_OK where IBV_WC_WITH_INV belongs (wc_flags "
          "0x%x), with the right invalidated_rkey: the known rxe defect; completions cannot "
          "be trusted to report remote invalidation on this device",
          wc.wc_flags));
    }
    return absl::FailedPreconditionError(absl::StrFormat(
        "receive completion lacks IBV_WC_WITH_INV (wc_flags 0x%x): the device delivered the "
        "SEND_WITH_INV as a plain SEND",
        wc.wc_flags));
  }
  if (wc.invalidated_rkey != rkey) {
    return absl::FailedPreconditionError(
        absl::StrFormat("receive completion invalidated rkey 0x%x, expected 0x%x",
                        wc.invalidated_rkey, rkey));
  }

  // Step 3: the key must now be dead. An RDMA READ with it fails with a remote access error.
  if (auto s = read_through_window(4); !s.ok()) return s;
  if (wc.status != IBV_WC_REM_ACCESS_ERR) {
    return absl::FailedPreconditionError(absl::StrCat(
        "RDMA_READ through the invalidated rkey completed with '", WcStatusName(wc.status),
        "', expected a remote access error: the window was not revoked"));
  }
  // Drain whatever flushed after the QPs went to error so nothing is left behind.
  ibv_wc drain[8];
  while ((*cq)->Poll(8, drain) > 0) {
  }
  return absl::OkStatus();
}

absl::StatusOr<Capabilities> ProbeCapabilities(const std::shared_ptr<Context>& context,
                                               const ProbeOptions& options) {
  Capabilities caps;
  caps.device = context->name();
  caps.kind = context->kind();
  absl::StatusOr<ibv_device_attr_ex> attr = context->QueryDevice();
  if (!attr.ok()) return attr.status();
  DecodeDeviceAttributes(*attr, &caps);

  caps.port_num = options.port_num;
  absl::StatusOr<ibv_port_attr> port = context->QueryPort(options.port_num);
  if (!port.ok()) return port.status();
  caps.port_state = port->state;
  caps.link_layer = port->link_layer;
  caps.active_mtu = port->active_mtu;
  caps.lid = port->lid;
  absl::StatusOr<int> gid_index = context->ResolveGidIndex(options.port_num, options.gid_index);
  if (gid_index.ok()) {
    caps.gid_index = *gid_index;
    if (absl::StatusOr<ibv_gid> gid = context->QueryGid(options.port_num, *gid_index); gid.ok()) {
      caps.gid = *gid;
    }
  } else {
    caps.gid_index = -1;
  }

  auto pd = ProtectionDomain::Create(context);
  if (!pd.ok()) return pd.status();
  auto cq = CompletionQueue::Create(context, 4);
  if (!cq.ok()) return cq.status();
  caps.max_inline_data = ProbeMaxInline(*pd, *cq);

  if (options.confirm_remote_invalidation) {
    caps.remote_invalidation_confirmation_required = true;
    if (!caps.remote_invalidation_advertised) {
      caps.remote_invalidation_selftest = SelfTest::kFailed;
      caps.selftest_detail = "not advertised (needs MEM_MGT_EXTENSIONS and a type 2 window)";
    } else if (!caps.port_active()) {
      caps.remote_invalidation_selftest = SelfTest::kNotRun;
      caps.selftest_detail = "port not active";
    } else if (!gid_index.ok()) {
      // Not the device's failure: nothing could connect through this port yet. Not run, so
      // not remembered either (an address may be configured later).
      caps.remote_invalidation_selftest = SelfTest::kNotRun;
      caps.selftest_detail = std::string(gid_index.status().message());
    } else {
      absl::Status s = RemoteInvalidationSelfTest(context, options);
      caps.remote_invalidation_selftest = s.ok() ? SelfTest::kPassed : SelfTest::kFailed;
      caps.selftest_detail = s.ok() ? "SEND_WITH_INV revoked a type 2 window" : s.ToString();
    }
  }
  return caps;
}

std::string FormatGid(const ibv_gid& gid) {
  char text[INET6_ADDRSTRLEN];
  if (inet_ntop(AF_INET6, gid.raw, text, sizeof(text)) == nullptr) return "?";
  return text;
}

const char* LinkLayerName(uint8_t link_layer) {
  switch (link_layer) {
    case IBV_LINK_LAYER_INFINIBAND: return "InfiniBand";
    case IBV_LINK_LAYER_ETHERNET: return "Ethernet (RoCE)";
    default: return "unspecified";
  }
}

const char* PortStateName(ibv_port_state state) {
  switch (state) {
    case IBV_PORT_NOP: return "NOP";
    case IBV_PORT_DOWN: return "DOWN";
    case IBV_PORT_INIT: return "INIT";
    case IBV_PORT_ARMED: return "ARMED";
    case IBV_PORT_ACTIVE: return "ACTIVE";
    case IBV_PORT_ACTIVE_DEFER: return "ACTIVE_DEFER";
  }
  return "?";
}

std::string FormatCapabilities(const Capabilities& caps) {
  auto yes = [](bool b) { return b ? "yes" : "no"; };
  std::string mw_types;
  if (caps.mw_type1) absl::StrAppend(&mw_types, " 1");
  if (caps.mw_type2a) absl::StrAppend(&mw_types, " 2A");
  if (caps.mw_type2b) absl::StrAppend(&mw_types, " 2B");
  if (mw_types.empty()) mw_types = " none";
  std::string out;
  absl::StrAppendFormat(&out, "%s (%s)\n", caps.device, DeviceKindName(caps.kind));
  absl::StrAppendFormat(&out, "  port %d: %s, %s, mtu %d, lid %d, gid [%d] %s\n",
                        caps.port_num, PortStateName(caps.port_state),
                        LinkLayerName(caps.link_layer), 128 << caps.active_mtu, caps.lid,
                        caps.gid_index, FormatGid(caps.gid));
  absl::StrAppendFormat(&out, "  memory windows:%s\n", mw_types);
  absl::StrAppendFormat(&out, "  remote invalidation (SEND_WITH_INV): advertised %s, self-test %s",
                        yes(caps.remote_invalidation_advertised),
                        SelfTestName(caps.remote_invalidation_selftest));
  if (!caps.selftest_detail.empty()) absl::StrAppend(&out, " (", caps.selftest_detail, ")");
  absl::StrAppend(&out, "\n");
  absl::StrAppendFormat(&out,
                        "  limits: qp %u x %u wr, sge %u, cqe %u, mr %u, mw %u, srq wr %u, "
                        "inline %u, rd_atom %u, atomics %s\n",
                        caps.max_qp, caps.max_qp_wr, caps.max_sge, caps.max_cqe, caps.max_mr,
                        caps.max_mw, caps.max_srq_wr, caps.max_inline_data, caps.max_qp_rd_atom,
                        yes(caps.atomics));
  absl::StrAppendFormat(&out, "  flags 0x%x: %s\n", caps.device_cap_flags,
                        absl::StrJoin(DeviceCapFlagNames(caps.flags), " "));
  return out;
}

const char* InvalidationModeName(InvalidationMode mode) {
  switch (mode) {
    case InvalidationMode::kRemote: return "remote (SEND_WITH_INV)";
    case InvalidationMode::kLocal: return "local fallback (LOCAL_INV)";
  }
  return "?";
}

absl::StatusOr<InvalidationMode> SelectInvalidationMode(bool local_capable, bool peer_capable,
                                                        InvalidationPolicy policy) {
  if (local_capable && peer_capable) return InvalidationMode::kRemote;
  if (policy == InvalidationPolicy::kAllowLocalFallback) return InvalidationMode::kLocal;
  std::string who = !local_capable && !peer_capable ? "neither side's device"
                    : !local_capable               ? "the local device"
                                                   : "the peer's device";
  return absl::FailedPreconditionError(absl::StrCat(
      "remote invalidation required but ", who,
      " cannot do it (needs SEND_WITH_INV and type 2 memory windows); refusing rather than "
      "falling back"));
}

}  // namespace swirl::verbs
