#include "rpc/establish.h"

#include <algorithm>

namespace swirl::internal {

WorkerOptions WorkerOptionsFor(const TransportOptions& transport) {
  WorkerOptions wo;
  wo.credits = transport.credits;
  wo.buffer_size = transport.buffer_size;
  wo.keepalive = transport.keepalive;
  wo.bulk_pool_bytes = transport.bulk_pool_bytes;
  wo.window_lease = transport.window_lease;
  return wo;
}

LocalConfig LocalConfigFor(const TransportOptions& transport, const verbs::Capabilities& caps) {
  LocalConfig local;
  local.credits = transport.credits;
  local.buffer_size = transport.buffer_size;
  local.max_inline = std::min<uint32_t>(caps.max_inline_data, 1024);
  local.require_remote_invalidation =
      transport.invalidation == InvalidationPolicy::kRequireRemote;
  local.allow_local_fallback = transport.invalidation != InvalidationPolicy::kRequireRemote;
  return local;
}

verbs::Capabilities DeclaredCapabilities(const verbs::Capabilities& caps,
                                         InvalidationPolicy policy) {
  verbs::Capabilities declared = caps;
  if (policy == InvalidationPolicy::kLocalOnly) declared.remote_invalidation_advertised = false;
  return declared;
}

}  // namespace swirl::internal
