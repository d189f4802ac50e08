#include "transport/verbs/capabilities.h"

#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>

namespace swirl::verbs {
namespace {

int CountSet(const DeviceCapFlags& flags) {
  int n = 0;
  for (const DeviceCapFlagInfo& info : DeviceCapFlagTable()) n += flags.*info.field ? 1 : 0;
  return n;
}

TEST(DeviceCapFlagTable, CoversEveryFieldOnceWithDistinctBits) {
  // Every field of DeviceCapFlags is a bool in the table; a field added without a table row
  // would make this fail.
  EXPECT_EQ(sizeof(DeviceCapFlags), DeviceCapFlagTable().size());
  std::set<int> bits;
  std::set<std::string> names;
  for (const DeviceCapFlagInfo& info : DeviceCapFlagTable()) {
    EXPECT_TRUE(bits.insert(info.bit).second) << "bit " << info.bit << " twice";
    EXPECT_TRUE(names.insert(info.name).second) << info.name << " twice";
    EXPECT_GE(info.bit, 0);
    EXPECT_LT(info.bit, 64);
  }
}

TEST(DeviceCapFlagTable, BitsMatchTheLibibverbsHeader) {
  struct {
    uint64_t header_value;
    const char* name;
  } expected[] = {
      {IBV_DEVICE_RESIZE_MAX_WR, "RESIZE_MAX_WR"},
      {IBV_DEVICE_BAD_PKEY_CNTR, "BAD_PKEY_CNTR"},
      {IBV_DEVICE_BAD_QKEY_CNTR, "BAD_QKEY_CNTR"},
      {IBV_DEVICE_RAW_MULTI, "RAW_MULTI"},
      {IBV_DEVICE_AUTO_PATH_MIG, "AUTO_PATH_MIG"},
      {IBV_DEVICE_CHANGE_PHY_PORT, "CHANGE_PHY_PORT"},
      {IBV_DEVICE_UD_AV_PORT_ENFORCE, "UD_AV_PORT_ENFORCE"},
      {IBV_DEVICE_CURR_QP_STATE_MOD, "CURR_QP_STATE_MOD"},
      {IBV_DEVICE_SHUTDOWN_PORT, "SHUTDOWN_PORT"},
      {IBV_DEVICE_INIT_TYPE, "INIT_TYPE"},
      {IBV_DEVICE_PORT_ACTIVE_EVENT, "PORT_ACTIVE_EVENT"},
      {IBV_DEVICE_SYS_IMAGE_GUID, "SYS_IMAGE_GUID"},
      {IBV_DEVICE_RC_RNR_NAK_GEN, "RC_RNR_NAK_GEN"},
      {IBV_DEVICE_SRQ_RESIZE, "SRQ_RESIZE"},
      {IBV_DEVICE_N_NOTIFY_CQ, "N_NOTIFY_CQ"},
      {IBV_DEVICE_MEM_WINDOW, "MEM_WINDOW"},
      {IBV_DEVICE_UD_IP_CSUM, "UD_IP_CSUM"},
      {IBV_DEVICE_XRC, "XRC"},
      {IBV_DEVICE_MEM_MGT_EXTENSIONS, "MEM_MGT_EXTENSIONS"},
      {IBV_DEVICE_MEM_WINDOW_TYPE_2A, "MEM_WINDOW_TYPE_2A"},
      {IBV_DEVICE_MEM_WINDOW_TYPE_2B, "MEM_WINDOW_TYPE_2B"},
      {IBV_DEVICE_RC_IP_CSUM, "RC_IP_CSUM"},
      {IBV_DEVICE_RAW_IP_CSUM, "RAW_IP_CSUM"},
      {IBV_DEVICE_MANAGED_FLOW_STEERING, "MANAGED_FLOW_STEERING"},
      {IBV_DEVICE_RAW_SCATTER_FCS, "RAW_SCATTER_FCS"},
      {IBV_DEVICE_PCI_WRITE_END_PADDING, "PCI_WRITE_END_PADDING"},
  };
  ASSERT_EQ(std::size(expected), DeviceCapFlagTable().size());
  for (const auto& e : expected) {
    std::vector<std::string> names = DeviceCapFlagNames(DecodeDeviceCapFlags(e.header_value));
    ASSERT_EQ(names.size(), 1u) << e.name;
    EXPECT_EQ(names[0], e.name);
  }
  // The seed's bit: bit 21 is remote invalidation's capability bit.
  EXPECT_EQ(IBV_DEVICE_MEM_MGT_EXTENSIONS, 1 << 21);
}

// Each single bit sets exactly its own field and nothing else; unnamed bits set nothing.
TEST(DecodeDeviceCapFlags, EachBitSetsExactlyOneCapability) {
  for (int bit = 0; bit < 64; ++bit) {
    DeviceCapFlags decoded = DecodeDeviceCapFlags(uint64_t{1} << bit);
    DeviceCapFlags expected;
    for (const DeviceCapFlagInfo& info : DeviceCapFlagTable()) {
      if (info.bit == bit) expected.*info.field = true;
    }
    EXPECT_EQ(std::memcmp(&decoded, &expected, sizeof(decoded)), 0) << "bit " << bit;
    EXPECT_LE(CountSet(decoded), 1) << "bit " << bit;
  }
}

// The complement: all bits but one must clear exactly that one capability. This is the shape of
// the original send-with-invalidate patch's bug (`flags |= ~IBV_DEVICE_KERNEL_SEND_W_INV`, which
// set every other capability).
TEST(DecodeDeviceCapFlags, AllButOneBitClearsExactlyThatCapability) {
  const int total = static_cast<int>(DeviceCapFlagTable().size());
  EXPECT_EQ(CountSet(DecodeDeviceCapFlags(~uint64_t{0})), total);
  EXPECT_EQ(CountSet(DecodeDeviceCapFlags(0)), 0);
  for (const DeviceCapFlagInfo& info : DeviceCapFlagTable()) {
    DeviceCapFlags decoded = DecodeDeviceCapFlags(~(uint64_t{1} << info.bit));
    EXPECT_FALSE(decoded.*info.field) << info.name;
    EXPECT_EQ(CountSet(decoded), total - 1) << info.name;
  }
}

ibv_device_attr_ex AttrWithFlags(uint64_t flags, uint32_t max_mw) {
  ibv_device_attr_ex attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.orig_attr.device_cap_flags = static_cast<unsigned int>(flags & 0xffffffffu);
  attr.device_cap_flags_ex = flags;
  attr.orig_attr.max_mw = static_cast<int>(max_mw);
  return attr;
}

TEST(DecodeDeviceAttributes, RemoteInvalidationNeedsBit21AndTypeTwoWindows) {
  Capabilities caps;
  DecodeDeviceAttributes(AttrWithFlags(IBV_DEVICE_MEM_MGT_EXTENSIONS, 1024), &caps);
  EXPECT_FALSE(caps.remote_invalidation_advertised) << "bit 21 without type 2 windows";

  caps = {};
  DecodeDeviceAttributes(AttrWithFlags(IBV_DEVICE_MEM_WINDOW_TYPE_2B, 1024), &caps);
  EXPECT_FALSE(caps.remote_invalidation_advertised) << "type 2B without bit 21";

  caps = {};
  DecodeDeviceAttributes(
      AttrWithFlags(IBV_DEVICE_MEM_MGT_EXTENSIONS | IBV_DEVICE_MEM_WINDOW_TYPE_2B, 0), &caps);
  EXPECT_FALSE(caps.remote_invalidation_advertised) << "max_mw == 0";

  caps = {};
  DecodeDeviceAttributes(AttrWithFlags(IBV_DEVICE_MEM_MGT_EXTENSIONS |
                                           IBV_DEVICE_MEM_WINDOW_TYPE_2B | IBV_DEVICE_MEM_WINDOW,
                                       1024),
                         &caps);
  EXPECT_TRUE(caps.remote_invalidation_advertised);
  EXPECT_TRUE(caps.mw_type1);
  EXPECT_FALSE(caps.mw_type2a);
  EXPECT_TRUE(caps.mw_type2b);
  EXPECT_TRUE(caps.remote_invalidation());
}

TEST(Capabilities, FailedSelfTestOverridesTheAdvertisedBit) {
  Capabilities caps;
  caps.remote_invalidation_advertised = true;
  caps.remote_invalidation_selftest = SelfTest::kFailed;
  EXPECT_FALSE(caps.remote_invalidation());
  caps.remote_invalidation_selftest = SelfTest::kPassed;
  EXPECT_TRUE(caps.remote_invalidation());
  caps.remote_invalidation_advertised = false;
  EXPECT_FALSE(caps.remote_invalidation()) << "a self-test cannot add what is not advertised";
}

// When the probe was asked to confirm, only a self-test that ran and passed counts: a port that
// was down (or had no address) when the probe ran proves nothing, so the device must not be
// offered as able to invalidate remotely.
TEST(Capabilities, AConfirmationThatCouldNotRunDoesNotCount) {
  Capabilities caps;
  caps.remote_invalidation_advertised = true;
  caps.remote_invalidation_confirmation_required = true;
  caps.remote_invalidation_selftest = SelfTest::kNotRun;
  EXPECT_FALSE(caps.remote_invalidation());
  caps.remote_invalidation_selftest = SelfTest::kFailed;
  EXPECT_FALSE(caps.remote_invalidation());
  caps.remote_invalidation_selftest = SelfTest::kPassed;
  EXPECT_TRUE(caps.remote_invalidation());
  // Without confirmation asked for, the advertised bit stands unless refuted.
  caps.remote_invalidation_confirmation_required = false;
  caps.remote_invalidation_selftest = SelfTest::kNotRun;
  EXPECT_TRUE(caps.remote_invalidation());
}

TEST(SelectInvalidationMode, RemoteOnlyWhenBothSidesCan) {
  for (auto policy : {InvalidationPolicy::kRequireRemote, InvalidationPolicy::kAllowLocalFallback}) {
    auto mode = SelectInvalidationMode(true, true, policy);
    ASSERT_TRUE(mode.ok());
    EXPECT_EQ(*mode, InvalidationMode::kRemote);
  }
}

TEST(SelectInvalidationMode, FallbackIsExplicitAndOnlyWhenAllowed) {
  for (auto [local, peer] : {std::pair{true, false}, {false, true}, {false, false}}) {
    auto fallback = SelectInvalidationMode(local, peer, InvalidationPolicy::kAllowLocalFallback);
    ASSERT_TRUE(fallback.ok());
    EXPECT_EQ(*fallback, InvalidationMode::kLocal);

    auto refused = SelectInvalidationMode(local, peer, InvalidationPolicy::kRequireRemote);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(refused.status().message().find("refusing"), absl::string_view::npos);
  }
  auto refused = SelectInvalidationMode(true, false, InvalidationPolicy::kRequireRemote);
  EXPECT_NE(refused.status().message().find("the peer's device"), absl::string_view::npos);
}

TEST(FormatGid, PrintsIpv6Notation) {
  ibv_gid gid{};
  gid.raw[0] = 0xfe;
  gid.raw[1] = 0x80;
  gid.raw[15] = 0x01;
  EXPECT_EQ(FormatGid(gid), "fe80::1");
}

TEST(FormatCapabilities, ShowsTheDecisionRelevantFacts) {
  Capabilities caps;
  caps.device = "dev0";
  caps.kind = DeviceKind::kSoft;
  caps.mw_type2b = true;
  caps.remote_invalidation_advertised = true;
  caps.remote_invalidation_selftest = SelfTest::kPassed;
  std::string text = FormatCapabilities(caps);
  EXPECT_NE(text.find("dev0 (soft)"), std::string::npos) << text;
  EXPECT_NE(text.find("memory windows: 2B"), std::string::npos) << text;
  EXPECT_NE(text.find("advertised yes, self-test passed"), std::string::npos) << text;
}

}  // namespace
}  // namespace swirl::verbs
