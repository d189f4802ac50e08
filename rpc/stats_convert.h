// The public stats structs (swirl/stats.h) from the control plane's messages and the device probe.

#ifndef SWIRL_RPC_STATS_CONVERT_H_
#define SWIRL_RPC_STATS_CONVERT_H_

#include "proto/control.pb.h"
#include "swirl/stats.h"
#include "transport/verbs/capabilities.h"

namespace swirl::internal {

NegotiatedSettings FromProto(const control::Negotiated& negotiated);
ConnectionStats FromProto(const control::ConnectionStats& stats);
StatsReport FromProto(const control::StatsResponse& stats);
DeviceInfo DescribeDevice(const verbs::Capabilities& caps);

}  // namespace swirl::internal

#endif  // SWIRL_RPC_STATS_CONVERT_H_
