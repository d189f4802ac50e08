// Device discovery and selection across rdma-core devices and swirl's soft device.
//
// Selection order for OpenDevice(""): the --swirl_device flag, then the SWIRL_DEVICE environment
// variable, then automatic: the first rdma-core device whose port 1 is ACTIVE, else the soft
// device "soft0". A name can be any rdma-core device name (mlx5_0, rxe0, ...) or softN.
// "rdma-core:NAME" opens NAME through libibverbs even if it is a soft device's name: with
// libswirl_soft_verbs.so preloaded (docs/SOFT_VERBS.md), "rdma-core:soft0" runs the code path a
// NIC takes (RdmaCoreDevice, libibverbs' exports) on the soft device.

#ifndef SWIRL_TRANSPORT_DEVICE_H_
#define SWIRL_TRANSPORT_DEVICE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/verbs/verbs.h"

ABSL_DECLARE_FLAG(std::string, swirl_device);

namespace swirl {

struct DeviceListing {
  std::string name;
  verbs::DeviceKind kind;
};

// Every device this process could open: rdma-core devices first, then the soft device.
absl::StatusOr<std::vector<DeviceListing>> ListDevices();

// Opens `name`, or selects one as described above when `name` is empty or "auto".
absl::StatusOr<std::shared_ptr<verbs::Context>> OpenDevice(absl::string_view name = "");

// The name OpenDevice("") would open right now, and why ("flag", "SWIRL_DEVICE", "auto: ...").
absl::StatusOr<std::pair<std::string, std::string>> SelectDeviceName();

}  // namespace swirl

#endif  // SWIRL_TRANSPORT_DEVICE_H_
