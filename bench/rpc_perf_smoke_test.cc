// Runs each rpc_perf test briefly (server and client in two processes on the soft device unless
// SWIRL_DEVICE says otherwise) and checks its --json output: the documented keys, the negotiated
// modes, and that the window counters say who revoked the windows. Asserts nothing about speed.

#include <gtest/gtest.h>

#include <string>

#include "bench/smoke_util.h"

namespace {

using swirl::bench_smoke::Json;
using swirl::bench_smoke::Parser;
using swirl::bench_smoke::ToolRun;

Json RunPerf(const std::string& args) {
  // Short runs; `timeout` keeps a wedged run from hanging the test.
  const ToolRun run = swirl::bench_smoke::RunCommand(
      "timeout 120 " + swirl::bench_smoke::BenchToolPath("rpc_perf") + " --json " + args);
  Json json;
  EXPECT_EQ(run.status, 0) << args << "\nstdout:\n" << run.out;
  EXPECT_TRUE(Parser(run.out).ParseDocument(&json)) << args << " printed:\n" << run.out;
  EXPECT_EQ(json.kind, Json::kObject) << args;
  return json;
}

double Number(const Json& j, const std::string& key) {
  EXPECT_TRUE(j.Has(key)) << "no " << key;
  if (!j.Has(key)) return -1;
  EXPECT_EQ(j[key].kind, Json::kNumber) << key;
  return j[key].number;
}

std::string String(const Json& j, const std::string& key) {
  EXPECT_TRUE(j.Has(key)) << "no " << key;
  if (!j.Has(key)) return "";
  EXPECT_EQ(j[key].kind, Json::kString) << key;
  return j[key].string;
}

TEST(RpcPerfSmoke, LatencyProtobufAndRaw) {
  for (const char* extra : {"", "--raw"}) {
    const Json j = RunPerf(std::string("--test latency --iters 2000 --warmup 100 ") + extra);
    EXPECT_EQ(String(j, "test"), "latency");
    EXPECT_EQ(String(j, "encoding"), std::string(extra).empty() ? "protobuf" : "raw");
    EXPECT_EQ(Number(j, "iters"), 2000);
    const double min = Number(j, "rtt_min_us"), p50 = Number(j, "rtt_p50_us");
    const double p99 = Number(j, "rtt_p99_us"), p999 = Number(j, "rtt_p999_us");
    EXPECT_GT(min, 0);
    EXPECT_LE(min, p50);
    EXPECT_LE(p50, p99);
    EXPECT_LE(p99, p999);
    EXPECT_GT(Number(j, "rtt_avg_us"), 0);
  }
}

// The shared harness: -D runs for the time given (at least 100 calls), --inflight > 1 times
// pipelined calls, --threads gives each thread a channel (and the server a worker), and every
// row carries its histogram with p99.99 and max.
TEST(RpcPerfSmoke, HarnessOptions) {
  const Json d = RunPerf("--test latency --raw -s 32 -D 0.2");
  EXPECT_EQ(Number(d, "size"), 32);
  EXPECT_GE(Number(d, "iters"), 100);
  EXPECT_GE(Number(d, "seconds"), 0.19);
  EXPECT_EQ(Number(d, "depth"), 1);
  const Json p = RunPerf("--test latency --inflight 4 -D 0.2");
  EXPECT_EQ(Number(p, "depth"), 4);
  EXPECT_GT(Number(p, "iters"), 0);
  const Json t = RunPerf("--test throughput --threads 2 --inflight 2 --seconds 0.2");
  EXPECT_EQ(Number(t, "threads"), 2);
  EXPECT_EQ(Number(t, "depth"), 2);
  EXPECT_GT(Number(t, "ops_per_s"), 0);
  const Json b = RunPerf("--test bulk_read -s 4096 --inflight 1 -D 0.2");
  EXPECT_EQ(Number(b, "depth"), 1);
  EXPECT_GT(Number(b, "gbytes_per_s"), 0);
  EXPECT_GT(Number(b, "windows_remote_invalidated"), 0);
  for (const Json* j : {&d, &p, &t, &b}) {
    EXPECT_LE(Number(*j, "rtt_p50_us"), Number(*j, "rtt_p99_us"));
    EXPECT_LE(Number(*j, "rtt_p999_us"), Number(*j, "rtt_p9999_us"));
    EXPECT_LE(Number(*j, "rtt_p9999_us"), Number(*j, "rtt_max_us"));
    ASSERT_TRUE(j->Has("histogram"));
    double total = 0;
    for (const Json& bucket : (*j)["histogram"]["buckets"].array) total += bucket.array[1].number;
    EXPECT_EQ(total, Number(*j, "iters"));
  }
}

// gRPC's unary echo with the same .proto, timed by the same harness.
TEST(RpcPerfSmoke, GrpcEchoPeer) {
  for (const char* extra : {"-n 300", "-D 0.2 --inflight 4", "-n 200 --threads 2"}) {
    const ToolRun run = swirl::bench_smoke::RunCommand(
        "timeout 120 " + swirl::bench_smoke::BenchToolPath("grpc_echo_perf") + " --json -s 100 " +
        extra);
    Json j;
    ASSERT_EQ(run.status, 0) << extra << "\n" << run.out;
    ASSERT_TRUE(Parser(run.out).ParseDocument(&j)) << run.out;
    EXPECT_EQ(String(j, "test"), "grpc_unary");
    EXPECT_EQ(Number(j, "size"), 100);
    EXPECT_GT(Number(j, "ops_per_s"), 0);
    EXPECT_LE(Number(j, "rtt_min_us"), Number(j, "rtt_p50_us"));
    EXPECT_LE(Number(j, "rtt_p50_us"), Number(j, "rtt_p9999_us"));
    EXPECT_LE(Number(j, "rtt_p9999_us"), Number(j, "rtt_max_us"));
  }
}

TEST(RpcPerfSmoke, Throughput) {
  const Json j = RunPerf("--test throughput --depth 8 --seconds 0.2");
  EXPECT_EQ(String(j, "test"), "throughput");
  EXPECT_EQ(Number(j, "depth"), 8);
  EXPECT_GT(Number(j, "ops_per_s"), 0);
}

TEST(RpcPerfSmoke, BulkModesReportWhoRevokedTheWindows) {
  // Default: the server exposes per-request windows and the client's acknowledgement revokes
  // them remotely; nothing is invalidated locally.
  const Json remote = RunPerf("--test bulk_read --size 65536 --depth 4 --seconds 0.2");
  EXPECT_EQ(String(remote, "invalidation"), "INVALIDATION_REMOTE");
  EXPECT_EQ(String(remote, "bulk_mode"), "BULK_SERVER_EXPOSES");
  EXPECT_GT(Number(remote, "gbytes_per_s"), 0);
  EXPECT_GT(Number(remote, "windows_remote_invalidated"), 0);
  EXPECT_EQ(Number(remote, "windows_locally_invalidated"), 0);
  // The explicit fallback says so, and its windows are revoked locally.
  const Json local = RunPerf(
      "--test bulk_write --size 65536 --depth 4 --seconds 0.2 --local_invalidation_only");
  EXPECT_EQ(String(local, "invalidation"), "INVALIDATION_LOCAL");
  EXPECT_EQ(Number(local, "windows_remote_invalidated"), 0);
  EXPECT_GT(Number(local, "windows_locally_invalidated"), 0);
}

TEST(RpcPerfSmoke, CompareTakesTurnsOnTwoChannels) {
  const Json j = RunPerf(
      "--test bulk_read --size 16384 --depth 4 --seconds 0.4 --slice_ms 20 "
      "--compare server-exposes+local-inv");
  EXPECT_EQ(String(j, "invalidation"), "INVALIDATION_REMOTE");
  EXPECT_EQ(String(j, "compare_invalidation"), "INVALIDATION_LOCAL");
  EXPECT_EQ(Number(j, "slices"), 20);
  EXPECT_GT(Number(j, "gbytes_per_s"), 0);
  EXPECT_GT(Number(j, "compare_gbytes_per_s"), 0);
  EXPECT_GT(Number(j, "ratio_p10"), 0);
  EXPECT_GT(Number(j, "ratio_median"), 0);
  EXPECT_GT(Number(j, "ratio_p90"), 0);
  // Each channel's windows went its own way.
  EXPECT_GT(Number(j, "windows_remote_invalidated"), 0);
  EXPECT_EQ(Number(j, "windows_locally_invalidated"), 0);
  EXPECT_EQ(Number(j, "compare_windows_remote_invalidated"), 0);
  EXPECT_GT(Number(j, "compare_windows_locally_invalidated"), 0);
}

TEST(RpcPerfSmoke, BadArgumentsAreRefusedBeforeAnyServerStarts) {
  // stderr goes to the pipe too: the message is what is checked. A server spawned before the
  // check would hold the pipe open and this test would time out instead.
  const std::string tool = swirl::bench_smoke::BenchToolPath("rpc_perf");
  const struct {
    const char* args;
    const char* message;
  } cases[] = {
      {"--test bulk_read --bulk_mode sideways", "unknown bulk mode sideways"},
      {"--test bulk_read --compare mirror+remote-inv", "unknown bulk mode mirror+remote-inv"},
      {"--test bulk_read --seconds 0", "--seconds must be positive"},
      {"--test bulk_read --compare mirror --slice_ms 0", "--slice_ms must be positive"},
  };
  for (const auto& c : cases) {
    const ToolRun run =
        swirl::bench_smoke::RunCommand("timeout 60 " + tool + " --json " + c.args + " 2>&1");
    EXPECT_EQ(run.status, 1) << c.args << "\n" << run.out;
    EXPECT_NE(run.out.find(c.message), std::string::npos) << c.args << "\n" << run.out;
  }
}

}  // namespace
