// How swirl's own code makes a ServerContext and hands it its bulk buffers: the constructor and
// the buffers are private in the public header (swirl/service.h), so that users only ever get a
// context from the worker that runs their handler.

#ifndef SWIRL_RPC_SERVER_CONTEXT_ACCESS_H_
#define SWIRL_RPC_SERVER_CONTEXT_ACCESS_H_

#include <atomic>
#include <optional>

#include "swirl/bulk.h"
#include "swirl/service.h"

namespace swirl::internal {

struct ServerContextAccess {
  // `connection` may be null for a handler run without one (tests, benchmarks): it must then not
  // ask for its caller, peer or a response bulk buffer.
  static ServerContext Make(Connection* connection, const std::atomic<bool>* cancelled) {
    return ServerContext(connection, cancelled);
  }
  // The context's bulk buffers (made empty on first use: ServerContext keeps none until then).
  static BulkBuffer& request_bulk(ServerContext& ctx) { return Made(ctx.request_bulk_); }
  static BulkBuffer& response_bulk(ServerContext& ctx) { return Made(ctx.response_bulk_); }
  // Whether the handler left a response bulk buffer (a non-empty one) in `ctx`.
  static bool has_response_bulk(const ServerContext& ctx) {
    return ctx.response_bulk_.has_value() && *ctx.response_bulk_;
  }

 private:
  static BulkBuffer& Made(std::optional<BulkBuffer>& buffer) {
    if (!buffer.has_value()) buffer.emplace();
    return *buffer;
  }
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_SERVER_CONTEXT_ACCESS_H_
