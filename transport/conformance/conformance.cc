#include "transport/conformance/conformance.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "transport/device.h"
#include "transport/verbs/rdma_core_device.h"
#include "transport/verbs/status.h"

namespace swirl::conformance {

// ---- Devices -----------------------------------------------------------------------------------

std::vector<std::string> DevicesUnderTest() {
  std::vector<std::string> names;
  if (const char* env = std::getenv("SWIRL_CONFORMANCE_DEVICES"); env != nullptr && *env != 0) {
    for (absl::string_view name : absl::StrSplit(env, ',', absl::SkipWhitespace())) {
      names.emplace_back(name);
    }
    return names;
  }
  names.emplace_back("soft0");
  absl::StatusOr<std::vector<std::string>> rdma_core = verbs::ListRdmaCoreDevices();
  if (rdma_core.ok()) {
    for (const std::string& name : *rdma_core) names.push_back(name);
  } else {
    std::fprintf(stderr, "conformance: cannot list rdma-core devices (%s); soft0 only\n",
                 rdma_core.status().ToString().c_str());
  }
  return names;
}

std::string DeviceParamName(const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

verbs::ConnectOptions DefaultConnectOptions() {
  verbs::ConnectOptions options;
  if (const char* env = std::getenv("SWIRL_CONFORMANCE_GID_INDEX")) {
    int index;
    if (absl::SimpleAtoi(env, &index)) options.gid_index = index;
  }
  return options;
}

DeviceFacts QueryFacts(verbs::Context& ctx) {
  DeviceFacts facts;
  absl::StatusOr<ibv_device_attr_ex> attr = ctx.QueryDevice();
  if (!attr.ok()) {
    // Not a reason to skip: the tests that ask would skip as if the device lacked the feature,
    // and a broken query would pass as a smaller device.
    ADD_FAILURE() << "ibv_query_device_ex failed, so this device's features are unknown: "
                  << attr.status();
    return facts;
  }
  const uint64_t flags = attr->orig_attr.device_cap_flags | attr->device_cap_flags_ex;
  facts.atomics = attr->orig_attr.atomic_cap != IBV_ATOMIC_NONE;
  facts.mw_type1 = (flags & IBV_DEVICE_MEM_WINDOW) != 0;
  facts.mw_type2 = (flags & (IBV_DEVICE_MEM_WINDOW_TYPE_2A | IBV_DEVICE_MEM_WINDOW_TYPE_2B)) != 0;
  return facts;
}

// ---- Memory ------------------------------------------------------------------------------------

Buffer::Buffer(size_t size) : size_(size) {
  const size_t rounded = (size + 4095) / 4096 * 4096;
  data_ = static_cast<char*>(std::aligned_alloc(4096, rounded == 0 ? 4096 : rounded));
  std::memset(data_, 0, rounded == 0 ? 4096 : rounded);
}

Buffer::~Buffer() { std::free(data_); }

void FillPattern(void* data, size_t length, uint64_t seed) {
  auto* p = static_cast<uint8_t*>(data);
  for (size_t i = 0; i < length; ++i) p[i] = PatternByte(seed, i);
}

int64_t FindPatternMismatch(const void* data, size_t length, uint64_t seed) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < length; ++i) {
    if (p[i] != PatternByte(seed, i)) return static_cast<int64_t>(i);
  }
  return -1;
}

// ---- Progress ----------------------------------------------------------------------------------

namespace {

std::mutex g_tracked_mu;
std::vector<std::weak_ptr<verbs::CompletionQueue>>& Tracked() {
  static auto* tracked = new std::vector<std::weak_ptr<verbs::CompletionQueue>>();
  return *tracked;
}

}  // namespace

void Track(const std::shared_ptr<verbs::CompletionQueue>& cq) {
  std::lock_guard<std::mutex> lock(g_tracked_mu);
  auto& tracked = Tracked();
  for (auto it = tracked.begin(); it != tracked.end();) {
    std::shared_ptr<verbs::CompletionQueue> live = it->lock();
    if (live == cq) return;
    it = live ? it + 1 : tracked.erase(it);
  }
  tracked.push_back(cq);
}

void Untrack(const verbs::CompletionQueue* cq) {
  std::lock_guard<std::mutex> lock(g_tracked_mu);
  auto& tracked = Tracked();
  for (auto it = tracked.begin(); it != tracked.end();) {
    std::shared_ptr<verbs::CompletionQueue> live = it->lock();
    it = (!live || live.get() == cq) ? tracked.erase(it) : it + 1;
  }
}

void ProgressAll(const verbs::CompletionQueue* except) {
  std::vector<std::shared_ptr<verbs::CompletionQueue>> cqs;
  {
    std::lock_guard<std::mutex> lock(g_tracked_mu);
    for (const auto& weak : Tracked()) {
      if (auto cq = weak.lock(); cq && cq.get() != except) cqs.push_back(std::move(cq));
    }
  }
  for (const auto& cq : cqs) ibv_poll_cq(cq->get(), 0, nullptr);
}

// ---- Endpoints ---------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Endpoint>> Endpoint::Create(const std::string& device,
                                                           const EndpointOptions& options) {
  absl::StatusOr<std::shared_ptr<verbs::Context>> ctx = OpenDevice(device);
  if (!ctx.ok()) return ctx.status();
  absl::StatusOr<std::shared_ptr<verbs::ProtectionDomain>> pd =
      verbs::ProtectionDomain::Create(*ctx);
  if (!pd.ok()) return pd.status();
  return Create(*pd, options);
}

absl::StatusOr<std::unique_ptr<Endpoint>> Endpoint::Create(
    std::shared_ptr<verbs::ProtectionDomain> pd, const EndpointOptions& options) {
  std::unique_ptr<Endpoint> ep(new Endpoint());
  ep->pd_ = std::move(pd);
  const std::shared_ptr<verbs::Context>& ctx = ep->pd_->shared_context();
  auto create_cq = [&](std::shared_ptr<verbs::CompletionChannel> channel) {
    if (!options.extended_cqs) {
      return verbs::CompletionQueue::Create(ctx, options.cq_entries, std::move(channel));
    }
    ibv_cq_init_attr_ex attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.cqe = static_cast<uint32_t>(options.cq_entries);
    attr.wc_flags = options.cq_wc_flags;
    return verbs::CompletionQueue::CreateEx(ctx, attr, std::move(channel));
  };
  ep->send_cq_ = options.send_cq;
  if (!ep->send_cq_) {
    auto cq = create_cq(nullptr);
    if (!cq.ok()) return cq.status();
    ep->send_cq_ = *cq;
  }
  ep->recv_cq_ = options.recv_cq;
  if (!ep->recv_cq_) {
    auto cq = create_cq(options.recv_channel);
    if (!cq.ok()) return cq.status();
    ep->recv_cq_ = *cq;
  }
  Track(ep->send_cq_);
  Track(ep->recv_cq_);
  verbs::QueuePairConfig config;
  config.send_cq = ep->send_cq_;
  config.recv_cq = ep->recv_cq_;
  config.srq = options.srq;
  config.max_send_wr = options.max_send_wr;
  config.max_recv_wr = options.max_recv_wr;
  config.max_send_sge = options.max_send_sge;
  config.max_recv_sge = options.max_recv_sge;
  config.max_inline_data = options.max_inline_data;
  config.sq_sig_all = options.sq_sig_all;
  config.send_ops_flags = options.send_ops_flags;
  auto qp = verbs::QueuePair::Create(ep->pd_, config);
  if (!qp.ok()) return qp.status();
  ep->qp_ = std::move(*qp);
  ep->buffer_ = std::make_unique<Buffer>(options.buffer_size);
  auto mr = verbs::MemoryRegion::Register(ep->pd_, ep->buffer_->data(), ep->buffer_->size(),
                                          options.mr_access);
  if (!mr.ok()) return mr.status();
  ep->mr_ = std::move(*mr);
  return ep;
}

int Endpoint::PostRecv(uint64_t wr_id, size_t offset, uint32_t length) {
  return PostRecv(wr_id, {ibv_sge{addr(offset), length, lkey()}});
}

int Endpoint::PostRecv(uint64_t wr_id, const std::vector<ibv_sge>& sges) {
  std::vector<ibv_sge> list = sges;
  ibv_recv_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = list.empty() ? nullptr : list.data();
  wr.num_sge = static_cast<int>(list.size());
  ibv_recv_wr* bad = nullptr;
  return ibv_post_recv(qp_->get(), &wr, &bad);
}

absl::Status ConnectPair(Endpoint& a, Endpoint& b, const verbs::ConnectOptions& a_options,
                         const verbs::ConnectOptions& b_options) {
  constexpr uint32_t kPsnA = 0x1a2b3c;
  constexpr uint32_t kPsnB = 0x4d5e6f;
  absl::StatusOr<verbs::PeerAddress> a_address = a.qp().LocalAddress(kPsnA, a_options);
  if (!a_address.ok()) return a_address.status();
  absl::StatusOr<verbs::PeerAddress> b_address = b.qp().LocalAddress(kPsnB, b_options);
  if (!b_address.ok()) return b_address.status();
  if (absl::Status s = a.qp().Connect(*b_address, kPsnA, a_options); !s.ok()) return s;
  return b.qp().Connect(*a_address, kPsnB, b_options);
}

void WarmUp(Endpoint& a, Endpoint& b) {
  constexpr uint64_t kWarmUpWrId = 0x3a3a3a3a;
  for (Endpoint* from : {&a, &b}) {
    Endpoint* to = from == &a ? &b : &a;
    ASSERT_EQ(to->PostRecv(kWarmUpWrId, std::vector<ibv_sge>{}), 0) << "warm-up receive";
    ASSERT_EQ(SendWr(kWarmUpWrId, IBV_WR_SEND).Post(from->ibqp()), 0) << "warm-up SEND";
    ExpectWc(Poll(to->recv_cq()),
             {.wr_id = kWarmUpWrId, .qp_num = to->qpn(), .opcode = IBV_WC_RECV, .byte_len = 0});
    ExpectWc(Poll(from->send_cq()),
             {.wr_id = kWarmUpWrId, .qp_num = from->qpn(), .opcode = IBV_WC_SEND});
  }
}

// ---- Work requests -----------------------------------------------------------------------------

SendWr::SendWr(uint64_t wr_id, ibv_wr_opcode opcode, unsigned int flags) {
  wr_.wr_id = wr_id;
  wr_.opcode = opcode;
  wr_.send_flags = flags;
}

SendWr& SendWr::Sge(uint64_t addr, uint32_t length, uint32_t lkey) {
  sges_.push_back(ibv_sge{addr, length, lkey});
  return *this;
}

SendWr& SendWr::Local(const Endpoint& ep, size_t offset, uint32_t length) {
  return Sge(ep.addr(offset), length, ep.lkey());
}

SendWr& SendWr::Remote(uint64_t remote_addr, uint32_t rkey) {
  wr_.wr.rdma.remote_addr = remote_addr;
  wr_.wr.rdma.rkey = rkey;
  return *this;
}

SendWr& SendWr::Imm(uint32_t imm_data) {
  wr_.imm_data = imm_data;
  return *this;
}

SendWr& SendWr::Invalidate(uint32_t rkey) {
  wr_.invalidate_rkey = rkey;
  return *this;
}

SendWr& SendWr::Atomic(uint64_t remote_addr, uint32_t rkey, uint64_t compare_add, uint64_t swap) {
  wr_.wr.atomic.remote_addr = remote_addr;
  wr_.wr.atomic.rkey = rkey;
  wr_.wr.atomic.compare_add = compare_add;
  wr_.wr.atomic.swap = swap;
  return *this;
}

SendWr& SendWr::Bind(ibv_mw* mw, uint32_t rkey, ibv_mr* mr, uint64_t addr, uint64_t length,
                     unsigned int access) {
  wr_.bind_mw.mw = mw;
  wr_.bind_mw.rkey = rkey;
  wr_.bind_mw.bind_info.mr = mr;
  wr_.bind_mw.bind_info.addr = addr;
  wr_.bind_mw.bind_info.length = length;
  wr_.bind_mw.bind_info.mw_access_flags = access;
  return *this;
}

SendWr& SendWr::Flags(unsigned int flags) {
  wr_.send_flags = flags;
  return *this;
}

SendWr& SendWr::Then(SendWr& next) {
  next_ = &next;
  return *this;
}

ibv_send_wr* SendWr::get() {
  wr_.next = next_ != nullptr ? next_->get() : nullptr;
  wr_.sg_list = sges_.empty() ? nullptr : sges_.data();
  wr_.num_sge = static_cast<int>(sges_.size());
  return &wr_;
}

int SendWr::Post(ibv_qp* qp, ibv_send_wr** bad_wr) {
  ibv_send_wr* bad = nullptr;
  int rc = ibv_post_send(qp, get(), &bad);
  if (bad_wr != nullptr) *bad_wr = bad;
  return rc;
}

ibv_wc BindType2(Endpoint& ep, ibv_mw* mw, uint32_t rkey, ibv_mr* mr, uint64_t addr,
                 uint64_t length, unsigned int access, uint64_t wr_id) {
  SendWr bind(wr_id, IBV_WR_BIND_MW);
  bind.Bind(mw, rkey, mr, addr, length, access);
  if (int rc = bind.Post(ep.ibqp()); rc != 0) {
    ADD_FAILURE() << "ibv_post_send(BIND_MW) returned " << rc << " (" << std::strerror(rc) << ")";
    ibv_wc wc{};
    wc.wr_id = kNoCompletion;
    wc.status = IBV_WC_GENERAL_ERR;
    return wc;
  }
  return Poll(ep.send_cq());
}

// ---- Completions -------------------------------------------------------------------------------

std::optional<ibv_wc> TryPoll(verbs::CompletionQueue& cq, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  ibv_wc wc;
  for (;;) {
    int n = cq.Poll(1, &wc);
    if (n == 1) return wc;
    if (n < 0) {
      ADD_FAILURE() << "ibv_poll_cq returned " << n << " (errno " << errno << ")";
      return std::nullopt;
    }
    if (absl::Now() >= deadline) return std::nullopt;
    ProgressAll(&cq);
  }
}

ibv_wc Poll(verbs::CompletionQueue& cq, absl::Duration timeout) {
  std::optional<ibv_wc> wc = TryPoll(cq, timeout);
  if (wc.has_value()) return *wc;
  ADD_FAILURE() << "no completion within " << absl::FormatDuration(timeout);
  ibv_wc none{};
  none.wr_id = kNoCompletion;
  none.status = IBV_WC_GENERAL_ERR;
  return none;
}

std::vector<ibv_wc> PollN(verbs::CompletionQueue& cq, int n, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<ibv_wc> out;
  while (static_cast<int>(out.size()) < n) {
    std::optional<ibv_wc> wc = TryPoll(cq, std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!wc.has_value()) {
      ADD_FAILURE() << "only " << out.size() << " of " << n << " completions within "
                    << absl::FormatDuration(timeout);
      break;
    }
    out.push_back(*wc);
  }
  return out;
}

std::vector<ibv_wc> Observe(verbs::CompletionQueue& cq, absl::Duration window) {
  const absl::Time end = absl::Now() + window;
  std::vector<ibv_wc> out;
  while (absl::Now() < end) {
    ibv_wc wc;
    int n = cq.Poll(1, &wc);
    if (n == 1) {
      out.push_back(wc);
      continue;
    }
    if (n < 0) break;
    ProgressAll(&cq);
  }
  return out;
}

bool WaitUntil(const std::function<bool()>& done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    if (done()) return true;
    if (absl::Now() >= deadline) return false;
    ProgressAll();
  }
}

ibv_qp_state StateOf(verbs::QueuePair& qp) {
  absl::StatusOr<ibv_qp_state> state = qp.QueryState();
  return state.ok() ? *state : IBV_QPS_UNKNOWN;
}

bool WaitForState(verbs::QueuePair& qp, ibv_qp_state state, absl::Duration timeout) {
  if (WaitUntil([&] { return StateOf(qp) == state; }, timeout)) return true;
  ADD_FAILURE() << "QP " << qp.qp_num() << " is " << verbs::QpStateName(StateOf(qp)) << ", not "
                << verbs::QpStateName(state) << ", after " << absl::FormatDuration(timeout);
  return false;
}

std::string Describe(const ibv_wc& wc) {
  return absl::StrFormat(
      "{wr_id=%#x status=%s(%d) opcode=%s(%d) byte_len=%u wc_flags=%#x imm/inv=%#x qp_num=%#x "
      "src_qp=%#x vendor_err=%#x}",
      wc.wr_id, verbs::WcStatusName(wc.status), wc.status, verbs::WcOpcodeName(wc.opcode),
      wc.opcode, wc.byte_len, wc.wc_flags, wc.imm_data, wc.qp_num, wc.src_qp, wc.vendor_err);
}

void ExpectWc(const ibv_wc& wc, const ExpectedWc& e) {
  SCOPED_TRACE(Describe(wc));
  EXPECT_EQ(wc.wr_id, e.wr_id) << "wr_id";
  EXPECT_EQ(wc.status, e.status) << "status: got " << verbs::WcStatusName(wc.status)
                                 << ", expected " << verbs::WcStatusName(e.status);
  EXPECT_EQ(wc.qp_num, e.qp_num) << "qp_num";
  if (e.opcode.has_value()) {
    EXPECT_EQ(wc.opcode, *e.opcode) << "opcode: got " << verbs::WcOpcodeName(wc.opcode)
                                    << ", expected " << verbs::WcOpcodeName(*e.opcode);
  }
  if (e.byte_len.has_value()) {
    EXPECT_EQ(wc.byte_len, *e.byte_len) << "byte_len";
  }
  if (e.wc_flags.has_value()) {
    EXPECT_EQ(wc.wc_flags, *e.wc_flags) << "wc_flags";
  }
  if (e.imm_data.has_value()) {
    EXPECT_EQ(wc.imm_data, *e.imm_data) << "imm_data";
  }
  if (e.invalidated_rkey.has_value()) {
    EXPECT_EQ(wc.invalidated_rkey, *e.invalidated_rkey) << "invalidated_rkey";
  }
  if (e.src_qp.has_value()) {
    EXPECT_EQ(wc.src_qp, *e.src_qp) << "src_qp";
  }
}

// ---- Fixture -----------------------------------------------------------------------------------

void DeviceTest::Connect(const EndpointOptions& a_options, const EndpointOptions& b_options,
                         const verbs::ConnectOptions& a_connect,
                         const verbs::ConnectOptions& b_connect) {
  absl::StatusOr<std::unique_ptr<Endpoint>> a = Endpoint::Create(device(), a_options);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  absl::StatusOr<std::unique_ptr<Endpoint>> b = Endpoint::Create(device(), b_options);
  ASSERT_TRUE(b.ok()) << b.status().ToString();
  a_ = std::move(*a);
  b_ = std::move(*b);
  SWIRL_ASSERT_OK(ConnectPair(*a_, *b_, a_connect, b_connect));
  WarmUp(*a_, *b_);
  // The *_rdma_core targets open soft0 through libibverbs: make sure they did, so they cannot
  // pass on the soft device's own path by mistake.
  if (absl::StartsWith(device(), "rdma-core:")) {
    ASSERT_EQ(a_->context().kind(), verbs::DeviceKind::kRdmaCore) << device();
  }
  // The *_tcp targets run this suite with the soft device on its TCP fabric: make sure it is,
  // so they cannot pass over shared memory by mistake (the GID would be fe80::/64 there).
  if (std::getenv("SWIRL_SOFT_TCP") != nullptr && absl::StartsWith(device_name(), "soft")) {
    auto ctx = OpenDevice(device());
    ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
    absl::StatusOr<ibv_gid> gid = (*ctx)->QueryGid(1, 0);
    ASSERT_TRUE(gid.ok()) << gid.status().ToString();
    ASSERT_TRUE(gid->raw[10] == 0xff && gid->raw[11] == 0xff)
        << "SWIRL_SOFT_TCP is set but " << device() << " is not on the TCP fabric";
  }
}

void DeviceTest::ConnectExtra(const std::shared_ptr<verbs::ProtectionDomain>& pd,
                              std::unique_ptr<Endpoint>* peer, std::unique_ptr<Endpoint>* on_pd,
                              const EndpointOptions& options) {
  absl::StatusOr<std::unique_ptr<Endpoint>> p = Endpoint::Create(device(), options);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  absl::StatusOr<std::unique_ptr<Endpoint>> o =
      pd ? Endpoint::Create(pd, options) : Endpoint::Create(device(), options);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  *peer = std::move(*p);
  *on_pd = std::move(*o);
  SWIRL_ASSERT_OK(ConnectPair(**peer, **on_pd));
  WarmUp(**peer, **on_pd);
}

void DeviceTest::OpenReceiverSide(int cqe, std::shared_ptr<verbs::ProtectionDomain>* pd,
                                  EndpointOptions* receiver_options) {
  auto ctx = OpenDevice(device());
  ASSERT_TRUE(ctx.ok()) << ctx.status().ToString();
  auto created = verbs::ProtectionDomain::Create(*ctx);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  *pd = std::move(*created);
  auto recv_cq = verbs::CompletionQueue::Create(*ctx, cqe);
  ASSERT_TRUE(recv_cq.ok()) << recv_cq.status().ToString();
  receiver_options->recv_cq = std::move(*recv_cq);
}

void DeviceTest::ConnectReceivers(const std::shared_ptr<verbs::ProtectionDomain>& pd,
                                  const EndpointOptions& receiver_options, int n,
                                  std::vector<std::unique_ptr<Endpoint>>* senders,
                                  std::vector<std::unique_ptr<Endpoint>>* receivers) {
  for (int i = 0; i < n; ++i) {
    auto receiver = Endpoint::Create(pd, receiver_options);
    ASSERT_TRUE(receiver.ok()) << receiver.status().ToString();
    auto sender = Endpoint::Create(device());
    ASSERT_TRUE(sender.ok()) << sender.status().ToString();
    SWIRL_ASSERT_OK(ConnectPair(**sender, **receiver));
    senders->push_back(std::move(*sender));
    receivers->push_back(std::move(*receiver));
  }
}

}  // namespace swirl::conformance
