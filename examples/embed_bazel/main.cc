// examples/embed_bazel: swirl as an external Bazel repository (@swirl). One process: a
// swirl::Server serving the Greeter service and a swirl::Channel calling it through the
// generated stub, over the soft device.
//
//   bazel-bin/greeter [DEVICE]     DEVICE defaults to soft0; exits 0 if the calls came back right.

#include <cstdio>
#include <string>

#include "greeter.swirl.h"
#include "swirl/channel.h"
#include "swirl/server.h"

namespace {

class GreeterImpl final : public embed_bazel::GreeterService {
 public:
  absl::Status SayHello(swirl::ServerContext&, const embed_bazel::HelloRequest& request,
                        embed_bazel::HelloReply* reply) override {
    reply->set_greeting("hello, " + request.name());
    return absl::OkStatus();
  }
  absl::Status SayHelloBlocking(swirl::ServerContext& context,
                                const embed_bazel::HelloRequest& request,
                                embed_bazel::HelloReply* reply) override {
    return SayHello(context, request, reply);
  }
};

int Fail(const char* what, const absl::Status& status) {
  std::fprintf(stderr, "embed_bazel: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string device = argc > 1 ? argv[1] : "soft0";

  swirl::ServerOptions server_options;
  server_options.address = "127.0.0.1:0";
  server_options.transport.device = device;
  swirl::Server server(server_options);
  GreeterImpl greeter;
  if (absl::Status s = server.RegisterService(&greeter); !s.ok()) return Fail("register", s);
  if (absl::Status s = server.Start(); !s.ok()) return Fail("start", s);

  int rc = 0;
  {
    swirl::ChannelOptions channel_options;
    channel_options.transport.device = device;
    channel_options.client_name = "embed_bazel";
    auto channel = swirl::Channel::Create(server.address(), channel_options);
    if (!channel.ok()) return Fail("connect", channel.status());

    embed_bazel::GreeterStub stub(**channel);
    for (int i = 0; i < 100 && rc == 0; ++i) {
      embed_bazel::HelloRequest request;
      request.set_name("swirl " + std::to_string(i));
      embed_bazel::HelloReply reply;
      absl::Status s = i % 2 == 0 ? stub.SayHello(request, &reply)
                                  : stub.SayHelloBlocking(request, &reply);
      if (!s.ok()) {
        rc = Fail("SayHello", s);
      } else if (reply.greeting() != "hello, " + request.name()) {
        std::fprintf(stderr, "embed_bazel: SayHello: got '%s'\n", reply.greeting().c_str());
        rc = 1;
      }
    }
    if (rc == 0) {
      std::printf("embed_bazel: 100 typed calls over %s OK (invalidation %s)\n",
                  server.capabilities().device.c_str(),
                  swirl::ControlPlaneName((*channel)->negotiated().invalidation));
    }
  }  // the channel closes before the server shuts down
  server.Shutdown();
  return rc;
}
