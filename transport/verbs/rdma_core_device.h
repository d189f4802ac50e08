// DeviceOps over rdma-core's libibverbs: InfiniBand and RoCE NICs (mlx5, irdma in RoCE mode,
// ...) and the kernel's rxe. iWARP devices (siw, cxgb4, irdma in iWARP mode) are refused at
// open: their connections need rdma_cm.

#ifndef SWIRL_TRANSPORT_VERBS_RDMA_CORE_DEVICE_H_
#define SWIRL_TRANSPORT_VERBS_RDMA_CORE_DEVICE_H_

#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "transport/verbs/device_ops.h"

namespace swirl::verbs {

// Names of the devices libibverbs reports (ibv_get_device_list). Empty, not an error, when the
// machine has none; an error only if the device list itself cannot be read.
absl::StatusOr<std::vector<std::string>> ListRdmaCoreDevices();

// Opens the named rdma-core device.
absl::StatusOr<std::unique_ptr<DeviceOps>> OpenRdmaCoreDevice(absl::string_view name);

}  // namespace swirl::verbs

#endif  // SWIRL_TRANSPORT_VERBS_RDMA_CORE_DEVICE_H_
