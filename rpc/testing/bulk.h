// Shared by the bulk-transfer tests against rpc/testing/test_server in another process
// (bulk_test, bulk_modes_test, bulk_security_test): payloads, the server's window counters as its
// Stats method reports them, and round trips that check the data.

#ifndef SWIRL_RPC_TESTING_BULK_H_
#define SWIRL_RPC_TESTING_BULK_H_

#include <gtest/gtest.h>

#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "rpc/testing/test_data.h"
#include "rpc/wire.h"
#include "swirl/channel.h"

namespace swirl::bulk_testing {

using ::swirl::testing::Pattern;

inline constexpr char kServer[] = "rpc/testing/test_server";

inline uint32_t Id(const char* m) { return rpc_wire::MethodId(m); }

inline std::string Payload(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 7 + seed * 13) & 0xff);
  return s;
}

struct ServerStats {
  uint64_t exposed, remote, local, lease_expired, violations;
};

inline ServerStats Stats(Channel& channel) {
  std::string out;
  EXPECT_TRUE(CallRaw(channel, Id("/test.E2E/Stats"), "", &out, {}).ok());
  std::vector<std::string> parts = absl::StrSplit(out, ' ');
  ServerStats s{};
  if (parts.size() == 5) {
    EXPECT_TRUE(absl::SimpleAtoi(parts[0], &s.exposed) && absl::SimpleAtoi(parts[1], &s.remote) &&
                absl::SimpleAtoi(parts[2], &s.local) &&
                absl::SimpleAtoi(parts[3], &s.lease_expired) &&
                absl::SimpleAtoi(parts[4], &s.violations));
  }
  return s;
}

// A verified bulk round trip: the check that "the server keeps serving its other clients and
// loses no data".
inline void ExpectHealthy(Channel& channel, int seed) {
  std::string request = Payload(100000 + seed, seed);
  std::string response;
  absl::Status s = CallRaw(channel, Id("/test.E2E/Echo"), request, &response, {});
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(response == request) << "echo of " << request.size() << " bytes came back wrong";
}

// Each size's payload comes back whole from `method` (an echo).
inline void ExpectEchoes(Channel& channel, const char* method,
                         std::initializer_list<size_t> sizes) {
  for (size_t size : sizes) {
    std::string request = Payload(size, static_cast<int>(size));
    std::string response;
    absl::Status s = CallRaw(channel, Id(method), request, &response, {});
    ASSERT_TRUE(s.ok()) << size << ": " << s;
    ASSERT_TRUE(response == request) << size;
  }
}

// `method` (a Fill) lands each size's pattern in `landing`, zero-copy, beside "filled".
inline void ExpectFillsInto(Channel& channel, const char* method, BulkBuffer& landing,
                            std::initializer_list<size_t> sizes) {
  for (size_t size : sizes) {
    CallOptions call_options;
    call_options.response_bulk = &landing;
    std::string response;
    absl::Status s = CallRaw(channel, Id(method), std::to_string(size), &response, call_options);
    ASSERT_TRUE(s.ok()) << size << ": " << s;
    EXPECT_EQ(response, "filled");
    ASSERT_EQ(landing.size(), size);
    for (size_t i = 0; i < size; i += 997) ASSERT_EQ(landing.data()[i], Pattern(i)) << i;
  }
}

// A channel to the test server on `port`, with its token.
inline absl::StatusOr<std::shared_ptr<Channel>> ConnectTo(int port, ChannelOptions options = {}) {
  options.auth_token = "e2e";
  return Channel::Create(absl::StrCat("127.0.0.1:", port), options);
}

}  // namespace swirl::bulk_testing

#endif  // SWIRL_RPC_TESTING_BULK_H_
