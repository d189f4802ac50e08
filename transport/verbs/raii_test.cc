// The RAII layer over a recording fake DeviceOps: release order, error statuses, no leaks.

#include <gtest/gtest.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "transport/verbs/verbs.h"

namespace swirl::verbs {
namespace {

struct Journal {
  std::vector<std::string> calls;
  std::map<std::string, int> fail_next;  // call -> errno to return once
  int live = 0;                          // objects created and not yet destroyed
  std::vector<int> masks;                // ModifyQp attr masks, in order
  std::vector<ibv_qp_attr> attrs;

  int Enter(const std::string& call) {
    calls.push_back(call);
    auto it = fail_next.find(call);
    if (it == fail_next.end()) return 0;
    int err = it->second;
    fail_next.erase(it);
    return err;
  }
  size_t IndexOf(const std::string& call) const {
    for (size_t i = 0; i < calls.size(); ++i) {
      if (calls[i] == call) return i;
    }
    ADD_FAILURE() << call << " never happened";
    return calls.size();
  }
};

Journal* g_journal = nullptr;  // for the C callbacks in ibv_context_ops

ibv_mw* FakeAllocMw(ibv_pd* pd, ibv_mw_type type) {
  if (int err = g_journal->Enter("alloc_mw"); err != 0) {
    errno = err;
    return nullptr;
  }
  ++g_journal->live;
  auto* mw = new ibv_mw{};
  mw->context = pd->context;
  mw->pd = pd;
  mw->type = type;
  mw->rkey = 0x1200;
  return mw;
}

int FakeDeallocMw(ibv_mw* mw) {
  g_journal->Enter("dealloc_mw");
  --g_journal->live;
  delete mw;
  return 0;
}

constexpr int kEmptyGidIndex = 5;

class FakeDeviceOps final : public DeviceOps {
 public:
  explicit FakeDeviceOps(Journal* journal) : journal_(journal) {
    std::memset(&context_, 0, sizeof(context_));
    context_.ops.alloc_mw = FakeAllocMw;
    context_.ops.dealloc_mw = FakeDeallocMw;
    context_.async_fd = -1;
  }
  ~FakeDeviceOps() override { journal_->Enter("close"); }

  DeviceKind kind() const override { return DeviceKind::kSoft; }
  const std::string& name() const override { return name_; }
  ibv_context* context() override { return &context_; }

  int QueryDevice(ibv_device_attr_ex*) override { return journal_->Enter("query_device"); }
  int QueryPort(uint8_t, ibv_port_attr* attr) override {
    attr->state = IBV_PORT_ACTIVE;
    attr->link_layer = IBV_LINK_LAYER_ETHERNET;
    attr->active_mtu = IBV_MTU_4096;
    return journal_->Enter("query_port");
  }
  // Set by a test: the IPv4 address went away (entries 2 and 3 read as empty).
  static inline bool ipv4_removed = false;
  // A ConnectX-style table: each address as RoCE v1 and as RoCE v2, link-local first.
  static std::vector<ibv_gid_entry> Table() {
    std::vector<ibv_gid_entry> table(4);
    for (uint32_t i = 0; i < 4; ++i) {
      ibv_gid_entry& e = table[i];
      std::memset(&e, 0, sizeof(e));
      e.gid_index = i;
      e.port_num = 1;
      e.gid_type = i % 2 == 0 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
      if (i < 2) {
        e.gid.raw[0] = 0xfe;
        e.gid.raw[1] = 0x80;
      } else {
        e.gid.raw[10] = e.gid.raw[11] = 0xff;
        e.gid.raw[12] = 10;
      }
      e.gid.raw[15] = 7;
    }
    if (ipv4_removed) table.resize(2);
    return table;
  }
  int QueryGid(uint8_t, int index, ibv_gid* gid) override {
    if (index == kEmptyGidIndex) {  // libibverbs reads an empty entry as zeros, successfully
      std::memset(gid, 0, sizeof(*gid));
      return journal_->Enter("query_gid");
    }
    if (index < 0 || index >= 4) return EINVAL;
    *gid = Table()[index].gid;
    return journal_->Enter("query_gid");
  }
  int QueryPkey(uint8_t, int, uint16_t*) override { return EOPNOTSUPP; }
  int QueryGidTable(uint8_t, std::vector<ibv_gid_entry>* entries) override {
    *entries = Table();
    return journal_->Enter("query_gid_table");
  }
  int AllocPd(ibv_pd** pd) override { return Create("alloc_pd", pd); }
  int DeallocPd(ibv_pd* pd) override { return Destroy("dealloc_pd", pd); }
  int RegMr(ibv_pd* pd, void* addr, size_t length, int, ibv_mr** mr) override {
    if (int err = Create("reg_mr", mr); err != 0) return err;
    (*mr)->pd = pd;
    (*mr)->addr = addr;
    (*mr)->length = length;
    (*mr)->lkey = (*mr)->rkey = 0x3400;
    return 0;
  }
  int DeregMr(ibv_mr* mr) override { return Destroy("dereg_mr", mr); }
  int ReregMr(ibv_mr*, int, ibv_pd*, void*, size_t, int) override { return EOPNOTSUPP; }
  int CreateCompChannel(ibv_comp_channel** ch) override { return Create("create_channel", ch); }
  int DestroyCompChannel(ibv_comp_channel* ch) override { return Destroy("destroy_channel", ch); }
  int CreateCq(int cqe, void*, ibv_comp_channel*, int, ibv_cq** cq) override {
    if (int err = Create("create_cq", cq); err != 0) return err;
    (*cq)->cqe = cqe;
    return 0;
  }
  int DestroyCq(ibv_cq* cq) override { return Destroy("destroy_cq", cq); }
  int ResizeCq(ibv_cq*, int) override { return EOPNOTSUPP; }
  int GetCqEvent(ibv_comp_channel*, ibv_cq**, void**) override { return EAGAIN; }
  void AckCqEvents(ibv_cq*, unsigned int) override {}
  int CreateSrq(ibv_pd*, ibv_srq_init_attr*, ibv_srq** srq) override {
    return Create("create_srq", srq);
  }
  int DestroySrq(ibv_srq* srq) override { return Destroy("destroy_srq", srq); }
  int ModifySrq(ibv_srq*, ibv_srq_attr*, int) override { return EOPNOTSUPP; }
  int QuerySrq(ibv_srq*, ibv_srq_attr*) override { return EOPNOTSUPP; }
  int CreateQp(ibv_pd*, ibv_qp_init_attr* attr, ibv_qp** qp) override {
    if (int err = Create("create_qp", qp); err != 0) return err;
    (*qp)->qp_num = 77;
    attr->cap.max_inline_data = 256;  // devices may grant more than asked
    return 0;
  }
  int ModifyQp(ibv_qp*, ibv_qp_attr* attr, int mask) override {
    journal_->masks.push_back(mask);
    journal_->attrs.push_back(*attr);
    return journal_->Enter("modify_qp");
  }
  int QueryQp(ibv_qp*, ibv_qp_attr* attr, int, ibv_qp_init_attr*) override {
    attr->qp_state = IBV_QPS_RTS;
    return journal_->Enter("query_qp");
  }
  int DestroyQp(ibv_qp* qp) override { return Destroy("destroy_qp", qp); }
  int GetAsyncEvent(ibv_async_event*) override { return EAGAIN; }
  void AckAsyncEvent(ibv_async_event*) override {}

 private:
  template <typename T>
  int Create(const std::string& call, T** out) {
    if (int err = journal_->Enter(call); err != 0) return err;
    *out = new T{};
    (*out)->context = &context_;
    ++journal_->live;
    return 0;
  }
  template <typename T>
  int Destroy(const std::string& call, T* object) {
    if (int err = journal_->Enter(call); err != 0) return err;
    --journal_->live;
    delete object;
    return 0;
  }

  Journal* journal_;
  std::string name_ = "fake0";
  ibv_context context_;
};

class RaiiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_journal = &journal_;
    context_ = Context::Wrap(std::make_unique<FakeDeviceOps>(&journal_));
  }
  void TearDown() override { g_journal = nullptr; }

  // What a QP test starts from: a PD, a 16-entry CQ, and a config completing into that CQ.
  struct QpParts {
    std::shared_ptr<ProtectionDomain> pd;
    std::shared_ptr<CompletionQueue> cq;
    QueuePairConfig config;
  };
  QpParts NewQpParts() {
    QpParts parts;
    parts.pd = *ProtectionDomain::Create(context_);
    parts.cq = *CompletionQueue::Create(context_, 16);
    parts.config.send_cq = parts.cq;
    parts.config.recv_cq = parts.cq;
    return parts;
  }

  Journal journal_;
  std::shared_ptr<Context> context_;
};

TEST_F(RaiiTest, ChildrenAreReleasedBeforeParentsWhateverTheHandleOrder) {
  std::shared_ptr<ProtectionDomain> pd = *ProtectionDomain::Create(context_);
  std::shared_ptr<CompletionChannel> channel = *CompletionChannel::Create(context_);
  std::shared_ptr<CompletionQueue> cq = *CompletionQueue::Create(context_, 16, channel);
  std::shared_ptr<SharedReceiveQueue> srq = *SharedReceiveQueue::Create(pd, 64, 1);
  char buffer[64];
  std::unique_ptr<MemoryRegion> mr =
      *MemoryRegion::Register(pd, buffer, sizeof(buffer), IBV_ACCESS_LOCAL_WRITE);
  std::unique_ptr<MemoryWindow> mw = *MemoryWindow::Allocate(pd, IBV_MW_TYPE_2);
  QueuePairConfig config;
  config.send_cq = cq;
  config.recv_cq = cq;
  config.srq = srq;
  std::unique_ptr<QueuePair> qp = *QueuePair::Create(pd, config);
  config = {};  // the config's handles are the caller's too
  EXPECT_EQ(journal_.live, 7);

  // Drop the parents' handles first: nothing may be released yet.
  context_.reset();
  pd.reset();
  channel.reset();
  cq.reset();
  srq.reset();
  EXPECT_EQ(journal_.live, 7);
  EXPECT_EQ(std::count(journal_.calls.begin(), journal_.calls.end(), "close"), 0);

  mr.reset();
  mw.reset();
  qp.reset();
  EXPECT_EQ(journal_.live, 0);

  // The QP goes before its CQ, SRQ and PD; the CQ before its channel; everything before close.
  EXPECT_LT(journal_.IndexOf("destroy_qp"), journal_.IndexOf("destroy_cq"));
  EXPECT_LT(journal_.IndexOf("destroy_qp"), journal_.IndexOf("destroy_srq"));
  EXPECT_LT(journal_.IndexOf("destroy_qp"), journal_.IndexOf("dealloc_pd"));
  EXPECT_LT(journal_.IndexOf("dereg_mr"), journal_.IndexOf("dealloc_pd"));
  EXPECT_LT(journal_.IndexOf("dealloc_mw"), journal_.IndexOf("dealloc_pd"));
  EXPECT_LT(journal_.IndexOf("destroy_srq"), journal_.IndexOf("dealloc_pd"));
  EXPECT_LT(journal_.IndexOf("destroy_cq"), journal_.IndexOf("destroy_channel"));
  EXPECT_EQ(journal_.IndexOf("close"), journal_.calls.size() - 1);
}

TEST_F(RaiiTest, FailedCreationNamesTheCallAndLeaksNothing) {
  std::shared_ptr<ProtectionDomain> pd = *ProtectionDomain::Create(context_);
  std::shared_ptr<CompletionQueue> cq = *CompletionQueue::Create(context_, 16);
  journal_.fail_next["create_qp"] = ENOMEM;
  QueuePairConfig config;
  config.send_cq = cq;
  config.recv_cq = cq;
  absl::StatusOr<std::unique_ptr<QueuePair>> qp = QueuePair::Create(pd, config);
  ASSERT_FALSE(qp.ok());
  EXPECT_EQ(qp.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(qp.status().message().find("ibv_create_qp"), absl::string_view::npos);
  EXPECT_NE(qp.status().message().find("Cannot allocate memory (errno 12)"),
            absl::string_view::npos);

  journal_.fail_next["reg_mr"] = EFAULT;
  char buffer[8];
  auto mr = MemoryRegion::Register(pd, buffer, sizeof(buffer), 0);
  ASSERT_FALSE(mr.ok());
  EXPECT_NE(mr.status().message().find("ibv_reg_mr(8 bytes): Bad address"),
            absl::string_view::npos)
      << mr.status();

  journal_.fail_next["alloc_mw"] = EOPNOTSUPP;
  auto mw = MemoryWindow::Allocate(pd, IBV_MW_TYPE_2);
  ASSERT_FALSE(mw.ok());
  EXPECT_EQ(mw.status().code(), absl::StatusCode::kUnimplemented);

  journal_.fail_next["alloc_pd"] = EACCES;
  auto pd2 = ProtectionDomain::Create(context_);
  EXPECT_EQ(pd2.status().code(), absl::StatusCode::kPermissionDenied);

  EXPECT_EQ(journal_.live, 2);  // the PD and CQ that did succeed
  config = {};
  pd.reset();
  cq.reset();
  EXPECT_EQ(journal_.live, 0);
}

TEST_F(RaiiTest, DeregisterReportsBusyAndKeepsOwnership) {
  std::shared_ptr<ProtectionDomain> pd = *ProtectionDomain::Create(context_);
  char buffer[64];
  std::unique_ptr<MemoryRegion> mr = *MemoryRegion::Register(pd, buffer, sizeof(buffer), 0);
  journal_.fail_next["dereg_mr"] = EBUSY;
  absl::Status s = mr->Deregister();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "ibv_dereg_mr: Device or resource busy (errno 16)");
  EXPECT_EQ(journal_.live, 2);
  EXPECT_TRUE(mr->Deregister().ok());
  EXPECT_EQ(journal_.live, 1);
  EXPECT_TRUE(mr->Deregister().ok()) << "second call is a no-op";
}

TEST_F(RaiiTest, TransitionsUseTheRequiredAttributeMasks) {
  auto [pd, cq, config] = NewQpParts();
  config.max_inline_data = 64;
  std::unique_ptr<QueuePair> qp = *QueuePair::Create(pd, config);
  EXPECT_EQ(qp->cap().max_inline_data, 256u) << "the granted value, not the requested one";

  ConnectOptions options;
  absl::StatusOr<PeerAddress> self = qp->LocalAddress(0x55, options);
  ASSERT_TRUE(self.ok()) << self.status();
  EXPECT_EQ(self->gid.raw[15], 7) << "RoCE port: the GID is part of the address";
  EXPECT_EQ(self->qp_num, 77u);
  EXPECT_EQ(self->mtu, IBV_MTU_4096);

  ASSERT_TRUE(qp->Connect(*self, 0x55, options).ok());
  ASSERT_EQ(journal_.masks.size(), 3u);
  EXPECT_EQ(journal_.masks[0], IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  EXPECT_EQ(journal_.masks[1], IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                                   IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
                                   IBV_QP_MIN_RNR_TIMER);
  EXPECT_EQ(journal_.masks[2], IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                                   IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
  EXPECT_EQ(journal_.attrs[1].ah_attr.is_global, 1);
  EXPECT_EQ(journal_.attrs[1].dest_qp_num, 77u);
  EXPECT_EQ(journal_.attrs[1].rq_psn, 0x55u);
  EXPECT_EQ(journal_.attrs[2].sq_psn, 0x55u);

  journal_.fail_next["modify_qp"] = EINVAL;
  absl::Status s = qp->ToError();
  EXPECT_EQ(s.message(), "ibv_modify_qp(ERR): Invalid argument (errno 22)");
}

TEST_F(RaiiTest, WithNoGidIndexGivenTheRoceV2Ipv4EntryIsUsedAndAGivenOneIsKept) {
  auto [pd, cq, config] = NewQpParts();
  for (int given : {kAutoGidIndex, 1}) {
    journal_.attrs.clear();
    std::unique_ptr<QueuePair> qp = *QueuePair::Create(pd, config);
    ConnectOptions options;
    options.gid_index = given;
    absl::StatusOr<PeerAddress> self = qp->LocalAddress(0x55, options);
    ASSERT_TRUE(self.ok()) << self.status();
    const int expected = given == kAutoGidIndex ? 3 : 1;
    const ibv_gid want = FakeDeviceOps::Table()[expected].gid;
    EXPECT_EQ(std::memcmp(&self->gid, &want, sizeof(ibv_gid)), 0) << "given " << given;
    ASSERT_TRUE(qp->Connect(*self, 0x55, options).ok());
    ASSERT_EQ(journal_.attrs.size(), 3u);
    EXPECT_EQ(journal_.attrs[1].ah_attr.grh.sgid_index, expected) << "given " << given;
  }
}

// The entry a QP advertised is the one it sends from, even if the table changes between the
// address exchange and RTR; and an index that cannot be one is refused, not truncated.
TEST_F(RaiiTest, RtrUsesTheAdvertisedGidEntryAndRefusesImpossibleIndexes) {
  auto [pd, cq, config] = NewQpParts();
  std::unique_ptr<QueuePair> qp = *QueuePair::Create(pd, config);
  ConnectOptions options;
  absl::StatusOr<PeerAddress> self = qp->LocalAddress(0x55, options);
  ASSERT_TRUE(self.ok()) << self.status();
  FakeDeviceOps::ipv4_removed = true;  // "automatic" would now pick entry 1
  const absl::Status connected = qp->Connect(*self, 0x55, options);
  FakeDeviceOps::ipv4_removed = false;
  ASSERT_TRUE(connected.ok()) << connected;
  ASSERT_EQ(journal_.attrs.size(), 3u);
  EXPECT_EQ(journal_.attrs[1].ah_attr.grh.sgid_index, 3);

  std::unique_ptr<QueuePair> other = *QueuePair::Create(pd, config);
  options.gid_index = 300;
  absl::StatusOr<PeerAddress> refused = other->LocalAddress(0x55, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
}

// An empty GID entry is not an address: a peer given zeros would have nothing to answer to.
TEST_F(RaiiTest, AnEmptyGidEntryIsRefusedNamingIt) {
  auto [pd, cq, config] = NewQpParts();
  std::unique_ptr<QueuePair> qp = *QueuePair::Create(pd, config);
  ConnectOptions options;
  options.gid_index = kEmptyGidIndex;
  absl::StatusOr<PeerAddress> refused = qp->LocalAddress(0x55, options);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("GID index 5 is empty"), std::string::npos)
      << refused.status();
}

// A device that cannot tell whether a peer is reachable (as a NIC cannot: the network decides)
// does not refuse one: DeviceOps::CheckReachable's default.
TEST_F(RaiiTest, ADeviceThatCannotTellLeavesReachabilityToTheNetwork) {
  ibv_gid local{}, remote{};
  local.raw[0] = 0xfe;
  local.raw[1] = 0x80;
  remote.raw[10] = remote.raw[11] = 0xff;
  remote.raw[12] = 10;
  EXPECT_TRUE(context_->CheckReachable(local, remote).ok());
  EXPECT_TRUE(context_->CheckReachable(remote, local).ok());
}

TEST(ChooseGidIndex, PrefersRoceV2ThenIpv4ThenGlobalAddresses) {
  auto entry = [](uint32_t index, uint32_t type, const char* kind) {
    ibv_gid_entry e;
    std::memset(&e, 0, sizeof(e));
    e.gid_index = index;
    e.gid_type = type;
    const std::string k = kind;
    if (k == "ipv4") {
      e.gid.raw[10] = e.gid.raw[11] = 0xff;
      e.gid.raw[12] = 192;
    } else if (k == "link-local") {
      e.gid.raw[0] = 0xfe;
      e.gid.raw[1] = 0x80;
    } else if (k == "global") {
      e.gid.raw[0] = 0x20;
      e.gid.raw[1] = 0x01;
    }  // "zero": left all zero
    if (k != "zero") e.gid.raw[15] = 1;
    return e;
  };
  constexpr uint32_t v1 = IBV_GID_TYPE_ROCE_V1, v2 = IBV_GID_TYPE_ROCE_V2, ib = IBV_GID_TYPE_IB;
  EXPECT_EQ(ChooseGidIndex({}), -1);
  EXPECT_EQ(ChooseGidIndex({entry(0, v2, "zero")}), -1);
  // ConnectX with one IPv4 address: v1/v2 link-local, then v1/v2 IPv4.
  EXPECT_EQ(ChooseGidIndex({entry(0, v1, "link-local"), entry(1, v2, "link-local"),
                            entry(2, v1, "ipv4"), entry(3, v2, "ipv4")}),
            3);
  EXPECT_EQ(ChooseGidIndex({entry(0, v2, "link-local"), entry(1, v2, "global"),
                            entry(2, v2, "ipv4")}),
            2);
  EXPECT_EQ(ChooseGidIndex({entry(0, v2, "link-local"), entry(5, v2, "global")}), 5);
  EXPECT_EQ(ChooseGidIndex({entry(0, v1, "ipv4"), entry(1, v2, "link-local")}), 1)
      << "any RoCE v2 entry before RoCE v1";
  EXPECT_EQ(ChooseGidIndex({entry(0, v1, "link-local"), entry(1, v1, "ipv4")}), 1);
  EXPECT_EQ(ChooseGidIndex({entry(4, ib, "link-local")}), 4);
  EXPECT_EQ(ChooseGidIndex({entry(0, v1, "zero"), entry(1, v1, "link-local")}), 1);
}

}  // namespace
}  // namespace swirl::verbs
