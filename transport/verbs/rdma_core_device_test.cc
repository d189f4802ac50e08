// Runs against every rdma-core device on the machine. Machines without one (CI, laptops,
// containers) skip the device tests and say so; the soft device's conformance suite covers the
// semantics there.

#include <gtest/gtest.h>

#include "transport/verbs/capabilities.h"
#include "transport/verbs/rdma_core_device.h"
#include "transport/verbs/verbs.h"

namespace swirl::verbs {
namespace {

TEST(RdmaCoreDevices, ListingNeverFailsForLackOfHardware) {
  absl::StatusOr<std::vector<std::string>> names = ListRdmaCoreDevices();
  ASSERT_TRUE(names.ok()) << names.status();
}

TEST(RdmaCoreDevices, OpeningAnUnknownNameIsNotFound) {
  auto ops = OpenRdmaCoreDevice("no_such_device_42");
  ASSERT_FALSE(ops.ok());
  EXPECT_EQ(ops.status().code(), absl::StatusCode::kNotFound);
}

TEST(RdmaCoreDevices, EveryDeviceProbesAndConfirmsRemoteInvalidationHonestly) {
  absl::StatusOr<std::vector<std::string>> names = ListRdmaCoreDevices();
  ASSERT_TRUE(names.ok()) << names.status();
  if (names->empty()) {
    GTEST_SKIP() << "no rdma-core device on this machine (ibv_get_device_list found none); "
                    "these tests run wherever one is present";
  }
  for (const std::string& name : *names) {
    SCOPED_TRACE(name);
    auto ops = OpenRdmaCoreDevice(name);
    ASSERT_TRUE(ops.ok()) << ops.status();
    std::shared_ptr<Context> context = Context::Wrap(std::move(*ops));
    ProbeOptions options;
    options.confirm_remote_invalidation = true;
    absl::StatusOr<Capabilities> caps = ProbeCapabilities(context, options);
    ASSERT_TRUE(caps.ok()) << caps.status();
    EXPECT_GT(caps->max_qp, 0u);
    EXPECT_GT(caps->max_cqe, 0u);
    if (caps->remote_invalidation_advertised && caps->port_active()) {
      // A device that advertises remote invalidation on an active port must deliver it: a
      // failed self-test there is a device (or driver) that would silently be weaker, which is
      // exactly what swirl exists to catch; its detail says what went wrong.
      EXPECT_EQ(caps->remote_invalidation_selftest, SelfTest::kPassed)
          << SelfTestName(caps->remote_invalidation_selftest) << ": " << caps->selftest_detail;
      EXPECT_TRUE(caps->remote_invalidation());
    }
    if (!caps->remote_invalidation_advertised) {
      EXPECT_FALSE(caps->remote_invalidation());
    }
    std::printf("%s", FormatCapabilities(*caps).c_str());
  }
}

}  // namespace
}  // namespace swirl::verbs
