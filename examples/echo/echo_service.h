// The echo service's implementation: the response carries the request's payload and sequence.
// Shared by examples/echo's server and bench/rpc_perf, so the benchmark measures the example.

#ifndef SWIRL_EXAMPLES_ECHO_ECHO_SERVICE_H_
#define SWIRL_EXAMPLES_ECHO_ECHO_SERVICE_H_

#include "examples/echo/echo.swirl.h"

namespace swirl::examples {

class EchoServiceImpl final : public EchoService {
 public:
  absl::Status Echo(ServerContext&, const EchoRequest& request, EchoResponse* response) override {
    response->set_payload(request.payload());
    response->set_sequence(request.sequence());
    return absl::OkStatus();
  }
};

}  // namespace swirl::examples

#endif  // SWIRL_EXAMPLES_ECHO_ECHO_SERVICE_H_
