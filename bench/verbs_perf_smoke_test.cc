// Runs each verbs_perf mode with a few iterations (both sides on this host, soft device unless
// SWIRL_DEVICE says otherwise) and checks that its --json output parses and has the documented
// keys. Deliberately asserts nothing about speed.

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/smoke_util.h"

namespace {

// ---- Running the tool -------------------------------------------------------------------------

using swirl::bench_smoke::Json;
using swirl::bench_smoke::Parser;
using swirl::bench_smoke::ToolRun;

std::string ToolPath() { return swirl::bench_smoke::BenchToolPath("verbs_perf"); }

ToolRun RunTool(const std::string& args) {
  // Iterations are few; the timeout keeps a wedged run from hanging the test.
  return swirl::bench_smoke::RunCommand(ToolPath() + " --timeout=30 " + args);
}

Json ParseOrFail(const ToolRun& run, const std::string& what) {
  Json json;
  EXPECT_EQ(run.status, 0) << what << " failed; stdout:\n" << run.out;
  // Exactly one line of output.
  EXPECT_FALSE(run.out.empty()) << what;
  if (!run.out.empty()) {
    EXPECT_EQ(run.out.find('\n'), run.out.size() - 1) << what << " printed more than one line";
  }
  EXPECT_TRUE(Parser(run.out).ParseDocument(&json)) << what << " printed invalid JSON:\n"
                                                    << run.out;
  EXPECT_EQ(json.kind, Json::kObject) << what;
  return json;
}

const char* const kCommonKeys[] = {"test", "device", "size", "iters"};
const char* const kLatencyKeys[] = {"rtt_min_us", "rtt_p50_us", "rtt_avg_us", "rtt_p99_us",
                                    "rtt_p999_us"};
const char* const kBwKeys[] = {"gbytes_per_s", "ops_per_s"};

void CheckResult(const Json& r, const std::string& test, bool bw, const std::string& what) {
  for (const char* key : kCommonKeys) ASSERT_TRUE(r.Has(key)) << what << ": no " << key;
  EXPECT_EQ(r["test"].kind, Json::kString);
  EXPECT_EQ(r["test"].string, test) << what;
  EXPECT_EQ(r["device"].kind, Json::kString);
  EXPECT_FALSE(r["device"].string.empty()) << what;
  EXPECT_EQ(r["size"].kind, Json::kNumber);
  EXPECT_GT(r["size"].number, 0) << what;
  EXPECT_EQ(r["iters"].kind, Json::kNumber);
  EXPECT_GT(r["iters"].number, 0) << what;
  if (bw) {
    for (const char* key : kBwKeys) {
      ASSERT_TRUE(r.Has(key)) << what << ": no " << key;
      EXPECT_EQ(r[key].kind, Json::kNumber) << what << ": " << key;
      EXPECT_GT(r[key].number, 0) << what << ": " << key;
    }
  } else {
    for (const char* key : kLatencyKeys) {
      ASSERT_TRUE(r.Has(key)) << what << ": no " << key;
      EXPECT_EQ(r[key].kind, Json::kNumber) << what << ": " << key;
      EXPECT_GT(r[key].number, 0) << what << ": " << key;
    }
    // Order only, never speed.
    EXPECT_LE(r["rtt_min_us"].number, r["rtt_p50_us"].number) << what;
    EXPECT_LE(r["rtt_p50_us"].number, r["rtt_p99_us"].number) << what;
    EXPECT_LE(r["rtt_p99_us"].number, r["rtt_p999_us"].number) << what;
  }
}

TEST(JsonParser, AcceptsAndRejects) {
  Json j;
  EXPECT_TRUE(Parser(R"({"a":[1,2.5e3,-3],"b":{"c":"x\"y"},"d":true,"e":null})").ParseDocument(&j));
  EXPECT_EQ(j["a"].array.size(), 3u);
  EXPECT_EQ(j["b"]["c"].string, "x\"y");
  Json k;
  EXPECT_FALSE(Parser(R"({"a":1,})").ParseDocument(&k));
  Json l;
  EXPECT_FALSE(Parser(R"({"a":1} {"b":2})").ParseDocument(&l));
  // Numbers: JSON's grammar, not strtod's (a tool printing nan must fail its smoke test).
  Json n;
  ASSERT_TRUE(Parser(R"([0, -0.5, 1e-05, 2E+3, 12.25])").ParseDocument(&n));
  EXPECT_EQ(n.array[2].number, 1e-05);
  EXPECT_EQ(n.array[3].number, 2000);
  EXPECT_EQ(n.array[4].number, 12.25);
  for (const char* bad : {"[nan]", "[-nan]", "[inf]", "[+1]", "[0x10]", "[01]", "[1.]", "[.5]",
                          "[1e]"}) {
    Json b;
    EXPECT_FALSE(Parser(bad).ParseDocument(&b)) << bad;
  }
}

TEST(VerbsPerfSmoke, Raw) {
  ToolRun run = RunTool("--raw --json --iters=2000");
  Json j = ParseOrFail(run, "--raw");
  ASSERT_EQ(j.kind, Json::kObject);
  CheckResult(j, "raw", false, "--raw");
  EXPECT_EQ(j["iters"].number, 2000);
}

class PerTest : public ::testing::TestWithParam<const char*> {};

TEST_P(PerTest, OneSizeJson) {
  const std::string test = GetParam();
  const bool bw = test.find("_bw") != std::string::npos;
  for (const char* size : {"1", "64", "100000"}) {
    const std::string what = test + " size " + size;
    ToolRun run = RunTool("--test=" + test + " --size=" + size + " --iters=200 --json");
    Json j = ParseOrFail(run, what);
    ASSERT_EQ(j.kind, Json::kObject) << what;
    CheckResult(j, test, bw, what);
    EXPECT_EQ(j["size"].number, std::stod(size)) << what;
    EXPECT_EQ(j["iters"].number, 200) << what;
  }
}

TEST_P(PerTest, NoInlineAndTextOutput) {
  const std::string test = GetParam();
  ToolRun json_run = RunTool("--test=" + test + " --size=32 --iters=50 --noinline --json");
  Json j = ParseOrFail(json_run, test + " --noinline");
  ASSERT_EQ(j.kind, Json::kObject);
  CheckResult(j, test, test.find("_bw") != std::string::npos, test + " --noinline");
  ToolRun text = RunTool("--test=" + test + " --size=32 --iters=50");
  EXPECT_EQ(text.status, 0) << text.out;
  EXPECT_NE(text.out.find("#bytes"), std::string::npos) << text.out;
}

INSTANTIATE_TEST_SUITE_P(AllTests, PerTest,
                         ::testing::Values("send_lat", "write_lat", "read_lat", "send_bw",
                                           "write_bw"));

TEST(VerbsPerfSmoke, SweepJson) {
  for (const char* test : {"write_lat", "send_bw"}) {
    ToolRun run = RunTool(std::string("--test=") + test + " -a --iters=3 --warmup=1 --json");
    Json j = ParseOrFail(run, std::string(test) + " -a");
    ASSERT_TRUE(j.Has("results")) << run.out;
    const Json& results = j["results"];
    ASSERT_EQ(results.kind, Json::kArray);
    ASSERT_EQ(results.array.size(), 23u);  // 2 B .. 8 MiB
    double expected = 2;
    for (const Json& r : results.array) {
      CheckResult(r, test, std::string(test) == "send_bw", std::string(test) + " -a");
      EXPECT_EQ(r["size"].number, expected);
      expected *= 2;
    }
  }
}

TEST(VerbsPerfSmoke, ServerAndConnect) {
  // The two-terminal form. Borrow a free port from the kernel (closing it leaves a tiny race).
  int probe = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(probe, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(probe, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  close(probe);
  const std::string port = std::to_string(ntohs(addr.sin_port));
  const std::string server = "timeout 60 " + ToolPath() + " --server --port=" + port +
                             " --server_core=1 --timeout=30 > /dev/null 2>&1 &";
  ASSERT_EQ(std::system(server.c_str()), 0);
  ToolRun run = RunTool("--connect=127.0.0.1 --port=" + port + " --test=read_lat --iters=100 --json");
  Json j = ParseOrFail(run, "--connect");
  ASSERT_EQ(j.kind, Json::kObject);
  CheckResult(j, "read_lat", false, "--connect");
}

}  // namespace
