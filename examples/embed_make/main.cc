// examples/embed_make: a program built with a plain Makefile against an installed swirl
// (`./swirl install --prefix DIR`). One process: a swirl::Server serving the Counter service
// and a swirl::Channel calling it through the generated stub, over the soft device.
//
//   counter [DEVICE]     DEVICE defaults to soft0; exits 0 if every call came back right.

#include <atomic>
#include <cstdio>
#include <memory>
#include <string>

#include "counter.swirl.h"
#include "swirl/channel.h"
#include "swirl/server.h"

namespace {

class CounterImpl final : public embed_make::CounterService {
 public:
  absl::Status Add(swirl::ServerContext&, const embed_make::AddRequest& request,
                   embed_make::AddReply* reply) override {
    reply->set_total(total_.fetch_add(request.value()) + request.value());
    calls_.fetch_add(1);
    return absl::OkStatus();
  }
  absl::Status Get(swirl::ServerContext&, const embed_make::GetRequest&,
                   embed_make::GetReply* reply) override {
    reply->set_total(total_.load());
    reply->set_calls(calls_.load());
    return absl::OkStatus();
  }

 private:
  std::atomic<int64_t> total_{0};
  std::atomic<uint64_t> calls_{0};
};

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "embed_make: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string device = argc > 1 ? argv[1] : "soft0";

  swirl::ServerOptions server_options;
  server_options.address = "127.0.0.1:0";
  server_options.transport.device = device;
  swirl::Server server(server_options);
  CounterImpl counter;
  if (absl::Status s = server.RegisterService(&counter); !s.ok()) return Fail("register", s);
  if (absl::Status s = server.Start(); !s.ok()) return Fail("start", s);

  int rc = 0;
  {
    swirl::ChannelOptions channel_options;
    channel_options.transport.device = device;
    channel_options.client_name = "embed_make";
    auto channel = swirl::Channel::Create(server.address(), channel_options);
    if (!channel.ok()) return Fail("connect", channel.status());

    embed_make::CounterStub stub(**channel);
    int64_t expected = 0;
    for (int i = 1; i <= 100 && rc == 0; ++i) {
      embed_make::AddRequest request;
      request.set_value(i);
      embed_make::AddReply reply;
      expected += i;
      if (absl::Status s = stub.Add(request, &reply); !s.ok()) {
        rc = Fail("Add", s);
      } else if (reply.total() != expected) {
        std::fprintf(stderr, "embed_make: Add: total %lld, expected %lld\n",
                     static_cast<long long>(reply.total()), static_cast<long long>(expected));
        rc = 1;
      }
    }
    embed_make::GetReply got;
    if (rc == 0) {
      if (absl::Status s = stub.Get(embed_make::GetRequest(), &got); !s.ok()) {
        rc = Fail("Get", s);
      } else if (got.total() != 5050 || got.calls() != 100) {
        std::fprintf(stderr, "embed_make: Get: total %lld after %llu calls, expected 5050/100\n",
                     static_cast<long long>(got.total()),
                     static_cast<unsigned long long>(got.calls()));
        rc = 1;
      }
    }
    if (rc == 0) {
      std::printf("embed_make: 101 typed calls over %s OK (total %lld, invalidation %s)\n",
                  server.capabilities().device.c_str(), static_cast<long long>(got.total()),
                  swirl::ControlPlaneName((*channel)->negotiated().invalidation));
    }
  }  // the channel closes before the server shuts down
  server.Shutdown();
  return rc;
}
