// TransportOptions, the settings a server and a channel share: what each field becomes in a
// worker's options and in the handshake's local configuration (rpc/establish.h, no device),
// and a server's invalidation policy end to end (in-process server and channel).

#include "swirl/transport_options.h"

#include <gtest/gtest.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "rpc/establish.h"
#include "swirl/channel.h"
#include "swirl/server.h"

namespace swirl {
namespace {

TransportOptions Unusual() {
  TransportOptions t;
  t.device = "soft3";
  t.port = 2;
  t.gid_index = 4;
  t.credits = 48;
  t.buffer_size = 8192 + 32;
  t.keepalive = absl::Seconds(7);
  t.bulk_pool_bytes = 3 << 20;
  t.window_lease = absl::Seconds(11);
  return t;
}

// The QP attribute the transport timer becomes: 4.096 us x 2^n, rounded up, 0 only for none.
TEST(TransportOptions, AckTimeoutBecomesTheSmallestQpTimeoutThatHoldsIt) {
  EXPECT_EQ(internal::AckTimeoutExponent(TransportOptions().ack_timeout), 17);  // 537 ms
  EXPECT_EQ(internal::AckTimeoutExponent(absl::Milliseconds(67)), 14);         // perftest's
  EXPECT_EQ(internal::AckTimeoutExponent(absl::ZeroDuration()), 0);
  EXPECT_EQ(internal::AckTimeoutExponent(-absl::Seconds(1)), 0);
  EXPECT_EQ(internal::AckTimeoutExponent(absl::Nanoseconds(1)), 1);
  EXPECT_EQ(internal::AckTimeoutExponent(absl::Nanoseconds(4096) * (1 << 20)), 20);
  EXPECT_EQ(internal::AckTimeoutExponent(absl::Nanoseconds(4096) * (1 << 20) +
                                         absl::Nanoseconds(1)),
            21);
  EXPECT_EQ(internal::AckTimeoutExponent(absl::Hours(100)), 31);
}

TEST(TransportOptions, EveryWorkerSettingComesFromThem) {
  const internal::WorkerOptions wo = internal::WorkerOptionsFor(Unusual());
  EXPECT_EQ(wo.credits, 48u);
  EXPECT_EQ(wo.buffer_size, 8192u + 32);
  EXPECT_EQ(wo.keepalive, absl::Seconds(7));
  EXPECT_EQ(wo.bulk_pool_bytes, size_t{3} << 20);
  EXPECT_EQ(wo.window_lease, absl::Seconds(11));
}

TEST(TransportOptions, TheHandshakeOffersWhatTheyAndTheDeviceSay) {
  verbs::Capabilities caps;
  caps.max_inline_data = 220;
  const internal::LocalConfig local = internal::LocalConfigFor(Unusual(), caps);
  EXPECT_EQ(local.credits, 48u);
  EXPECT_EQ(local.buffer_size, 8192u + 32);
  EXPECT_EQ(local.max_inline, 220u);
  caps.max_inline_data = 4096;  // what a QP may inline is capped whatever the device says
  EXPECT_EQ(internal::LocalConfigFor(Unusual(), caps).max_inline, 1024u);
}

TEST(TransportOptions, TheInvalidationPolicyIsWhatEachSideAsksAndDeclares) {
  verbs::Capabilities caps;
  caps.mw_type2b = true;
  caps.remote_invalidation_advertised = true;
  TransportOptions t;
  struct Case {
    InvalidationPolicy policy;
    bool require, allow_fallback, declares_remote;
  };
  for (const Case& c : {Case{InvalidationPolicy::kPreferRemote, false, true, true},
                        Case{InvalidationPolicy::kRequireRemote, true, false, true},
                        Case{InvalidationPolicy::kLocalOnly, false, true, false}}) {
    t.invalidation = c.policy;
    const internal::LocalConfig local = internal::LocalConfigFor(t, caps);
    EXPECT_EQ(local.require_remote_invalidation, c.require) << static_cast<int>(c.policy);
    EXPECT_EQ(local.allow_local_fallback, c.allow_fallback) << static_cast<int>(c.policy);
    EXPECT_EQ(internal::DeclaredCapabilities(caps, c.policy).remote_invalidation(),
              c.declares_remote)
        << static_cast<int>(c.policy);
  }
}

TEST(TransportOptions, EqualOnlyIfEveryFieldIs) {
  EXPECT_EQ(Unusual(), Unusual());
  EXPECT_NE(Unusual(), TransportOptions());
  TransportOptions other = Unusual();
  other.keepalive = absl::Seconds(8);
  EXPECT_NE(other, Unusual());
  other = Unusual();
  other.invalidation = InvalidationPolicy::kLocalOnly;
  EXPECT_NE(other, Unusual());
}

// A server whose policy is kLocalOnly declares no remote invalidation, so a client that can do
// it still gets the explicit fallback, and both sides say so.
TEST(TransportOptions, AServerAskingForTheFallbackGetsIt) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.transport.invalidation = InvalidationPolicy::kLocalOnly;
  Server server(options);
  ASSERT_TRUE(server.Start().ok());
  ASSERT_TRUE(server.capabilities().remote_invalidation) << "the device itself can";
  auto channel = Channel::Create(absl::StrCat("127.0.0.1:", server.port()));
  ASSERT_TRUE(channel.ok()) << channel.status();
  EXPECT_EQ((*channel)->negotiated().invalidation, InvalidationMode::kLocal);
  EXPECT_FALSE(server.Stats().capabilities.remote_invalidation);
}

// The server's transport defaults differ from a channel's in the bulk pool only.
TEST(TransportOptions, AServersDefaultsHaveTheLargerBulkPool) {
  TransportOptions server = ServerOptions().transport;
  EXPECT_EQ(server.bulk_pool_bytes, size_t{128} << 20);
  server.bulk_pool_bytes = ChannelOptions().transport.bulk_pool_bytes;
  EXPECT_EQ(server, ChannelOptions().transport);
}

}  // namespace
}  // namespace swirl
