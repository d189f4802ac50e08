#include "rpc/testing/test_client.h"

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "swirl/call.h"

namespace swirl::testing {

absl::StatusOr<std::shared_ptr<Channel>> ConnectTo(int port, ChannelOptions options) {
  options.auth_token = kTestToken;
  return Channel::Create(absl::StrCat("127.0.0.1:", port), options);
}

std::string Echo(Channel& channel, const std::string& request) {
  std::string response;
  absl::Status s = CallRaw(channel, MethodOf("/test.E2E/Echo"), request, &response,
                           CallOptions{absl::Seconds(10)});
  return s.ok() ? response : s.ToString();
}

}  // namespace swirl::testing
