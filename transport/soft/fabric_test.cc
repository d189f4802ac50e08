// The fabric seam (fabric.h): a device opens on the fabric its environment names, its QPs and
// CQs use that fabric, and each fabric reaches only GIDs of its own kind.

#include "transport/soft/fabric.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "transport/soft/soft_device.h"
#include "transport/soft/soft_internal.h"
#include "transport/soft/test_side.h"
#include "transport/verbs/verbs.h"

namespace swirl::soft {
namespace {

// SWIRL_SOFT_TCP as given for the life of the object (null: unset), restored after. A device
// reads it when it is first opened in the process.
class ScopedTcpEnv {
 public:
  explicit ScopedTcpEnv(const char* spec) {
    if (const char* old = std::getenv("SWIRL_SOFT_TCP")) saved_ = old, had_ = true;
    if (spec != nullptr) {
      setenv("SWIRL_SOFT_TCP", spec, 1);
    } else {
      unsetenv("SWIRL_SOFT_TCP");
    }
  }
  ~ScopedTcpEnv() {
    if (had_) {
      setenv("SWIRL_SOFT_TCP", saved_.c_str(), 1);
    } else {
      unsetenv("SWIRL_SOFT_TCP");
    }
  }

 private:
  std::string saved_;
  bool had_ = false;
};

Hca* HcaOf(Side& side) { return ToSoft(side.ctx->get())->hca; }

ibv_gid ShmGid() {  // fe80::1
  ibv_gid gid{};
  gid.raw[0] = 0xfe;
  gid.raw[1] = 0x80;
  gid.raw[15] = 1;
  return gid;
}

ibv_gid TcpGid() {  // ::ffff:127.0.0.1, port 7000 in bytes 8-9
  ibv_gid gid{};
  gid.raw[8] = 7000 >> 8;
  gid.raw[9] = 7000 & 0xff;
  gid.raw[10] = gid.raw[11] = 0xff;
  gid.raw[12] = 127;
  gid.raw[15] = 1;
  return gid;
}

// Without SWIRL_SOFT_TCP a device is on shared memory: no poll hook (its polls read nothing
// but the rings), and its QPs publish through the same fabric the HCA has.
TEST(Fabric, ADeviceWithoutSwirlSoftTcpIsOnSharedMemory) {
  ScopedTcpEnv env(nullptr);
  Side side = MakeSide("soft0");
  Hca* hca = HcaOf(side);
  ASSERT_NE(hca->fabric, nullptr);
  EXPECT_EQ(hca->fabric->kind(), Fabric::Kind::kSharedMemory);
  EXPECT_EQ(hca->fabric->poll_hook(), nullptr);
  EXPECT_EQ(AsSoft(side.cq->get())->pull_links, nullptr);
  EXPECT_EQ(static_cast<SoftQp*>(side.qp->get())->fabric, hca->fabric.get());
  EXPECT_FALSE(IsTcpFabricGid(hca->gid));
}

// With it, the device listens on TCP: its GID names the listener, its CQs' polls read the
// links, and its QPs use the TCP fabric.
TEST(Fabric, ADeviceWithSwirlSoftTcpIsOnTcp) {
  ScopedTcpEnv env("127.0.0.1");
  Side side = MakeSide("soft1");
  Hca* hca = HcaOf(side);
  ASSERT_NE(hca->fabric, nullptr);
  EXPECT_EQ(hca->fabric->kind(), Fabric::Kind::kTcp);
  EXPECT_NE(hca->fabric->poll_hook(), nullptr);
  EXPECT_EQ(AsSoft(side.cq->get())->pull_links, hca->fabric->poll_hook());
  EXPECT_EQ(static_cast<SoftQp*>(side.qp->get())->fabric, hca->fabric.get());
  EXPECT_TRUE(IsTcpFabricGid(hca->gid));
}

// A shared-memory device reaches shared-memory GIDs only, a TCP device TCP GIDs only, and the
// device's CheckReachable (what a server asks of a client's GID) says so from its own GID.
TEST(Fabric, EachFabricReachesOnlyGidsOfItsOwnKind) {
  Side shm_side = [] {
    ScopedTcpEnv env(nullptr);
    return MakeSide("soft2");
  }();
  Side tcp_side = [] {
    ScopedTcpEnv env("127.0.0.1");
    return MakeSide("soft3");
  }();
  const Fabric& shm = *HcaOf(shm_side)->fabric;
  const Fabric& tcp = *HcaOf(tcp_side)->fabric;
  EXPECT_TRUE(shm.Reaches(ShmGid()));
  EXPECT_FALSE(shm.Reaches(TcpGid()));
  EXPECT_TRUE(tcp.Reaches(TcpGid()));
  EXPECT_FALSE(tcp.Reaches(ShmGid()));
  EXPECT_TRUE(shm.Reaches(HcaOf(shm_side)->gid));
  EXPECT_FALSE(shm.Reaches(HcaOf(tcp_side)->gid));
  EXPECT_TRUE(tcp.Reaches(HcaOf(tcp_side)->gid));
  EXPECT_FALSE(tcp.Reaches(HcaOf(shm_side)->gid));

  for (Side* side : {&shm_side, &tcp_side}) {
    const ibv_gid own = HcaOf(*side)->gid;
    const bool on_tcp = side == &tcp_side;
    const ibv_gid same = on_tcp ? TcpGid() : ShmGid();
    const ibv_gid other = on_tcp ? ShmGid() : TcpGid();
    EXPECT_TRUE(side->ctx->CheckReachable(own, same).ok()) << on_tcp;
    absl::Status refused = side->ctx->CheckReachable(own, other);
    EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
    EXPECT_NE(refused.message().find(on_tcp ? "is on shared memory" : "is on TCP"),
              absl::string_view::npos)
        << refused;
  }
}

}  // namespace
}  // namespace swirl::soft
