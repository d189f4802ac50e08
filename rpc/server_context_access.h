// How swirl's own code makes a ServerContext and hands it its bulk buffers: the constructor and
// the buffers are private in the public header (swirl/service.h), so that users only ever get a
// context from the worker that runs their handler.

#ifndef SWIRL_RPC_SERVER_CONTEXT_ACCESS_H_
#define SWIRL_RPC_SERVER_CONTEXT_ACCESS_H_

#include <atomic>

#include "swirl/bulk.h"
#include "swirl/service.h"

namespace swirl::internal {

struct ServerContextAccess {
  // `connection` may be null for a handler run without one (tests, benchmarks): it must then not
  // ask for its caller, peer or a response bulk buffer.
  static ServerContext Make(Connection* connection, const std::atomic<bool>* cancelled) {
    return ServerContext(connection, cancelled);
  }
  static BulkBuffer& request_bulk(ServerContext& ctx) { return ctx.request_bulk_; }
  static BulkBuffer& response_bulk(ServerContext& ctx) { return ctx.response_bulk_; }
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_SERVER_CONTEXT_ACCESS_H_
