// What tests of rpc/testing/test_server do on the client side, written once: channels to it and
// echoes through it (its stats: server_stats.h).

#ifndef SWIRL_RPC_TESTING_TEST_CLIENT_H_
#define SWIRL_RPC_TESTING_TEST_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "rpc/wire.h"
#include "swirl/channel.h"

namespace swirl::testing {

inline constexpr char kTestServer[] = "rpc/testing/test_server";
inline constexpr char kTestToken[] = "e2e";  // test_server's default --token

inline uint32_t MethodOf(const char* full_name) { return rpc_wire::MethodId(full_name); }

// A channel to the test server on this host's `port`, with its token.
absl::StatusOr<std::shared_ptr<Channel>> ConnectTo(int port, ChannelOptions options = {});

// test.E2E/Echo of `request`: the answer, or the call's status as text.
std::string Echo(Channel& channel, const std::string& request);

}  // namespace swirl::testing

#endif  // SWIRL_RPC_TESTING_TEST_CLIENT_H_
