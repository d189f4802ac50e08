// `./swirl devices`: every RDMA device this process can open, with the capabilities swirl
// decides on (memory window types, remote invalidation and its self-test, limits), like a short
// ibv_devinfo. The self-test runs on every device with an active port.

#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "transport/device.h"
#include "transport/verbs/capabilities.h"
#include "transport/verbs/rdma_core_device.h"

ABSL_FLAG(bool, selftest, true,
          "confirm remote invalidation with a loopback SEND_WITH_INV self-test");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Lists RDMA devices and the capabilities swirl decides on.");
  absl::ParseCommandLine(argc, argv);
  auto devices = swirl::ListDevices();
  if (!devices.ok()) {
    std::fprintf(stderr, "swirl devices: %s\n", devices.status().ToString().c_str());
    return 1;
  }
  int rdma_core = 0;
  for (const auto& d : *devices) rdma_core += d.kind == swirl::verbs::DeviceKind::kRdmaCore;
  if (rdma_core == 0) {
    std::printf("No rdma-core device present (ibv_get_device_list found none): swirl runs on its "
                "soft device here.\n\n");
  }
  int failures = 0;
  for (const auto& d : *devices) {
    auto context = swirl::OpenDevice(d.name);
    if (!context.ok()) {
      std::printf("%s (%s): cannot open: %s\n\n", d.name.c_str(),
                  swirl::verbs::DeviceKindName(d.kind), context.status().ToString().c_str());
      ++failures;
      continue;
    }
    swirl::verbs::ProbeOptions options;
    options.confirm_remote_invalidation = absl::GetFlag(FLAGS_selftest);
    auto caps = swirl::verbs::ProbeCapabilities(*context, options);
    if (!caps.ok()) {
      std::printf("%s (%s): probe failed: %s\n\n", d.name.c_str(),
                  swirl::verbs::DeviceKindName(d.kind), caps.status().ToString().c_str());
      ++failures;
      continue;
    }
    std::printf("%s\n", swirl::verbs::FormatCapabilities(*caps).c_str());
  }
  auto selected = swirl::SelectDeviceName();
  if (selected.ok()) {
    std::printf("Default device: %s (%s)\n", selected->first.c_str(), selected->second.c_str());
  }
  return failures == 0 ? 0 : 1;
}
