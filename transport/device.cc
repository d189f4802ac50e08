#include "transport/device.h"

#include <cstdlib>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "transport/soft/soft_device.h"
#include "transport/verbs/rdma_core_device.h"

ABSL_FLAG(std::string, swirl_device, "",
          "RDMA device to use (an rdma-core name like mlx5_0, or soft0); empty: SWIRL_DEVICE, "
          "else the first active rdma-core device, else soft0");

namespace swirl {
namespace {

// Exactly swirl's names (soft0 .. soft9999): an rdma-core device may be called "softroce0".
bool IsSoftName(absl::string_view name) { return soft::IsSoftDeviceName(name); }

// An rdma-core device is usable if its first port is ACTIVE.
bool PortActive(const std::string& name) {
  auto ops = verbs::OpenRdmaCoreDevice(name);
  if (!ops.ok()) return false;
  ibv_port_attr attr{};
  return (*ops)->QueryPort(1, &attr) == 0 && attr.state == IBV_PORT_ACTIVE;
}

}  // namespace

absl::StatusOr<std::vector<DeviceListing>> ListDevices() {
  std::vector<DeviceListing> devices;
  absl::StatusOr<std::vector<std::string>> names = verbs::ListRdmaCoreDevices();
  if (!names.ok()) return names.status();
  for (const std::string& name : *names) devices.push_back({name, verbs::DeviceKind::kRdmaCore});
  devices.push_back({soft::kDefaultSoftDeviceName, verbs::DeviceKind::kSoft});
  return devices;
}

absl::StatusOr<std::pair<std::string, std::string>> SelectDeviceName() {
  std::string flag = absl::GetFlag(FLAGS_swirl_device);
  if (!flag.empty() && flag != "auto") return std::make_pair(flag, std::string("--swirl_device"));
  if (const char* env = std::getenv("SWIRL_DEVICE"); env != nullptr && *env && 
      absl::string_view(env) != "auto") {
    return std::make_pair(std::string(env), std::string("SWIRL_DEVICE"));
  }
  absl::StatusOr<std::vector<std::string>> names = verbs::ListRdmaCoreDevices();
  if (!names.ok()) return names.status();
  for (const std::string& name : *names) {
    if (PortActive(name)) {
      return std::make_pair(name, std::string("auto: first rdma-core device with an active port"));
    }
  }
  return std::make_pair(std::string(soft::kDefaultSoftDeviceName),
                        std::string(names->empty() ? "auto: no rdma-core device present"
                                                   : "auto: no rdma-core port is active"));
}

absl::StatusOr<std::shared_ptr<verbs::Context>> OpenDevice(absl::string_view name) {
  std::string chosen(name);
  if (chosen.empty() || chosen == "auto") {
    auto selected = SelectDeviceName();
    if (!selected.ok()) return selected.status();
    chosen = selected->first;
  }
  absl::string_view device = chosen;
  const bool through_rdma_core = absl::ConsumePrefix(&device, "rdma-core:");
  if (IsSoftName(device) && !through_rdma_core) {
    auto ops = soft::OpenSoftDevice(device);
    if (!ops.ok()) return ops.status();
    return verbs::Context::Wrap(std::move(*ops));
  }
  auto ops = verbs::OpenRdmaCoreDevice(std::string(device));
  if (!ops.ok()) return ops.status();
  return verbs::Context::Wrap(std::move(*ops));
}

}  // namespace swirl
