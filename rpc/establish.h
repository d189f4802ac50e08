// Internal: what a Server and a Channel both do to set up connections, written once so that a
// new transport setting is added in one place: TransportOptions turned into a worker's options
// and into the handshake's local configuration, and the capabilities a side declares.

#ifndef SWIRL_RPC_ESTABLISH_H_
#define SWIRL_RPC_ESTABLISH_H_

#include "rpc/handshake.h"
#include "rpc/transport_options.h"
#include "rpc/worker.h"
#include "transport/verbs/capabilities.h"

namespace swirl::internal {

// The worker settings `transport` gives (credits, buffers, keepalive, bulk pool, lease); each
// side adds its own (name, core, thread, connection count, server limits, callbacks).
WorkerOptions WorkerOptionsFor(const TransportOptions& transport);

// What a side offers in the handshake, from `transport` and its device's `caps`; each side adds
// its own (a server's bulk limits, a client's bulk mode and pool).
LocalConfig LocalConfigFor(const TransportOptions& transport, const verbs::Capabilities& caps);

// `caps` as a side declares them to its peer and negotiates with: without remote invalidation
// under InvalidationPolicy::kLocalOnly.
verbs::Capabilities DeclaredCapabilities(const verbs::Capabilities& caps,
                                         InvalidationPolicy policy);

}  // namespace swirl::internal

#endif  // SWIRL_RPC_ESTABLISH_H_
