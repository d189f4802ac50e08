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
#include <utility>
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

// With stderr in the output (for the refusals' messages).
ToolRun RunToolWithStderr(const std::string& args) {
  return swirl::bench_smoke::RunCommand("timeout 60 " + ToolPath() + " --timeout=30 " + args +
                                        " 2>&1");
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
                                    "rtt_p999_us", "rtt_p9999_us", "rtt_max_us"};
const char* const kBwKeys[] = {"gbytes_per_s", "ops_per_s"};

// The histogram every latency row carries: base/histogram.h's buckets, counts adding up to the
// iterations, lower edges increasing, the extremes inside [min, max].
void CheckHistogram(const Json& r, const std::string& what) {
  ASSERT_TRUE(r.Has("histogram")) << what;
  const Json& h = r["histogram"];
  EXPECT_EQ(h["unit"].string, "ns") << what;
  EXPECT_EQ(h["sub_bucket_bits"].number, 7) << what;
  ASSERT_EQ(h["buckets"].kind, Json::kArray) << what;
  ASSERT_FALSE(h["buckets"].array.empty()) << what;
  double total = 0, previous = -1;
  for (const Json& b : h["buckets"].array) {
    ASSERT_EQ(b.array.size(), 2u) << what;
    EXPECT_GT(b.array[0].number, previous) << what;
    previous = b.array[0].number;
    EXPECT_GT(b.array[1].number, 0) << what;
    total += b.array[1].number;
  }
  EXPECT_EQ(total, r["iters"].number) << what;
  // Buckets are at most 1/128 wide: the first and last lower edges sit at or below min and max.
  EXPECT_LE(h["buckets"].array.front().array[0].number, r["rtt_min_us"].number * 1000 + 0.5);
  EXPECT_LE(h["buckets"].array.back().array[0].number, r["rtt_max_us"].number * 1000 + 0.5);
}

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
    EXPECT_LE(r["rtt_p999_us"].number, r["rtt_p9999_us"].number) << what;
    EXPECT_LE(r["rtt_p9999_us"].number, r["rtt_max_us"].number) << what;
    CheckHistogram(r, what);
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

// perftest's spelling of the options and perftest's own keys beside swirl's: one-way = RTT/2,
// except RDMA READ.
TEST(VerbsPerfSmoke, PerftestOptionsAndKeys) {
  for (const char* test : {"send_lat", "read_lat"}) {
    ToolRun run = RunTool(std::string("--test ") + test + " -s 128 -n 300 --json");
    Json j = ParseOrFail(run, test);
    ASSERT_EQ(j.kind, Json::kObject);
    CheckResult(j, test, false, test);
    EXPECT_EQ(j["size"].number, 128);
    EXPECT_EQ(j["iters"].number, 300);
    EXPECT_EQ(j["MsgSize"].number, 128);
    EXPECT_EQ(j["n_iterations"].number, 300);
    const double divisor = std::string(test) == "read_lat" ? 1 : 2;
    for (const auto& [perftest_key, rtt_key] :
         std::vector<std::pair<std::string, std::string>>{{"t_min", "rtt_min_us"},
                                                          {"t_typical", "rtt_p50_us"},
                                                          {"t_avg", "rtt_avg_us"},
                                                          {"t_max", "rtt_max_us"},
                                                          {"percentile_99", "rtt_p99_us"},
                                                          {"percentile_99.9", "rtt_p999_us"},
                                                          {"percentile_99.99", "rtt_p9999_us"}}) {
      ASSERT_TRUE(j.Has(perftest_key)) << test << ": no " << perftest_key;
      EXPECT_NEAR(j[perftest_key].number, j[rtt_key].number / divisor, 1e-3)
          << test << " " << perftest_key;
    }
  }
  ToolRun bw = RunTool("--test write_bw -s 4096 -n 400 --json");
  Json b = ParseOrFail(bw, "write_bw");
  ASSERT_EQ(b.kind, Json::kObject);
  for (const char* key : {"MsgSize", "n_iterations", "BW_average", "BW_peak", "MsgRate"}) {
    ASSERT_TRUE(b.Has(key)) << key;
    EXPECT_GT(b[key].number, 0) << key;
  }
}

// -D: each size runs for the given time (and at least 100 iterations) with the server not
// told the count; latency, SEND bandwidth (the server reposts receives) and WRITE latency (the
// server spins on memory) all end and report.
TEST(VerbsPerfSmoke, DurationMode) {
  for (const char* test : {"send_lat", "write_lat", "send_bw", "bind_inv"}) {
    const bool bw = std::string(test) == "send_bw";
    ToolRun run = RunTool(std::string("--test ") + test + " -s 64 -D 0.2 --json");
    Json j = ParseOrFail(run, test);
    ASSERT_EQ(j.kind, Json::kObject);
    CheckResult(j, test, bw, test);
    if (!bw) {
      EXPECT_GE(j["iters"].number, 100) << test;
    }
    // Measured for the whole duration (the tools calibrate the clock as they go: 1% slack).
    if (!bw) {
      EXPECT_GE(j["seconds"].number, 0.198) << test;
    }
  }
}

// --csv: a header and one line per size; -H: the whole histogram after the row, in
// HdrHistogram's percentile-distribution layout, ending at percentile 1 with every sample.
TEST(VerbsPerfSmoke, CsvAndHistogram) {
  ToolRun csv = RunTool("--test send_lat -a -n 5 --warmup=1 --csv");
  ASSERT_EQ(csv.status, 0) << csv.out;
  std::vector<std::string> lines;
  for (size_t at = 0, nl; (nl = csv.out.find('\n', at)) != std::string::npos; at = nl + 1) {
    lines.push_back(csv.out.substr(at, nl - at));
  }
  ASSERT_EQ(lines.size(), 24u) << csv.out;  // header + 2 B .. 8 MiB
  EXPECT_EQ(lines[0].rfind("tool,test,size,iters,warmup,seconds,rtt_min_us,rtt_p50_us", 0), 0u);
  EXPECT_EQ(lines[1].rfind("verbs_perf,send_lat,2,5,1,", 0), 0u) << lines[1];
  EXPECT_EQ(lines[23].rfind("verbs_perf,send_lat,8388608,5,1,", 0), 0u) << lines[23];

  ToolRun h = RunTool("--test send_lat -n 1000 -H");
  ASSERT_EQ(h.status, 0) << h.out;
  const size_t header = h.out.find("Value     Percentile TotalCount 1/(1-Percentile)");
  ASSERT_NE(header, std::string::npos) << h.out;
  const size_t total = h.out.find("Total count    =         1000]");
  EXPECT_NE(total, std::string::npos) << h.out;
  // The last bucket line: percentile 1 and all 1000 samples.
  const size_t mean = h.out.find("#[Mean");
  ASSERT_NE(mean, std::string::npos);
  const size_t last_line = h.out.rfind('\n', mean - 2);
  EXPECT_NE(h.out.substr(last_line, mean - last_line).find(" 1.000000000000       1000"),
            std::string::npos)
      << h.out.substr(last_line, mean - last_line);
}

// --out_json writes the same report to a file (perftest's flag), alongside the table.
TEST(VerbsPerfSmoke, OutJsonFile) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/verbs_perf_out.json";
  std::remove(path.c_str());
  ToolRun run = RunTool("--test read_lat -n 200 --out_json --out_json_file=" + path);
  ASSERT_EQ(run.status, 0) << run.out;
  EXPECT_NE(run.out.find("#bytes"), std::string::npos) << "the table is still printed";
  FILE* f = std::fopen(path.c_str(), "r");
  ASSERT_NE(f, nullptr) << path;
  std::string text;
  char buffer[4096];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof(buffer), f)) > 0) text.append(buffer, n);
  std::fclose(f);
  Json j;
  ASSERT_TRUE(Parser(text).ParseDocument(&j)) << text;
  CheckResult(j, "read_lat", false, "--out_json");
}

// The window tests: an exposed transfer per iteration, revoked three ways; each reports the
// exposing side's time per window. bind_inv checks every answer for IBV_WC_WITH_INV of its key
// (the run fails otherwise).
class WindowTest : public ::testing::TestWithParam<const char*> {};

TEST_P(WindowTest, ReportsTransfersAndWindowCost) {
  const std::string test = GetParam();
  for (const char* op : {"read", "write"}) {
    const std::string what = test + " " + op;
    ToolRun run = RunTool("--test " + test + " -s 4096 -n 300 --json --window_op " + op);
    Json j = ParseOrFail(run, what);
    ASSERT_EQ(j.kind, Json::kObject) << what;
    CheckResult(j, test, false, what);
    EXPECT_EQ(j["window_op"].string, op) << what;
    EXPECT_GT(j["ops_per_s"].number, 0) << what;
    EXPECT_GT(j["gbytes_per_s"].number, 0) << what;
    if (test == "static_mr") {
      EXPECT_FALSE(j.Has("window_ns")) << what << ": nothing is exposed per transfer";
    } else {
      ASSERT_TRUE(j.Has("window_ns")) << what;
      EXPECT_GT(j["window_ns"].number, 0) << what;
      EXPECT_GT(j["windows_per_s_per_core"].number, 0) << what;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllWindowTests, WindowTest,
                         ::testing::Values("static_mr", "bind_inv", "bind_local_inv", "reg_mr"));

TEST(VerbsPerfSmoke, RefusesWhatItCannotDo) {
  const struct {
    const char* args;
    const char* message;
  } cases[] = {
      {"--test send_lat --inflight 4", "--inflight: a latency test keeps one message in flight"},
      {"--test send_lat --threads 2", "--threads: verbs_perf runs one QP per process pair"},
      {"--test bind_inv -s 8", "window tests need --size >= 16"},
      {"--test send_lat --json --csv", "--json and --csv are two ways to print"},
      {"--test sideways", "unknown --test 'sideways'"},
  };
  for (const auto& c : cases) {
    ToolRun run = RunToolWithStderr(c.args);
    EXPECT_EQ(run.status, 1) << c.args << "\n" << run.out;
    EXPECT_NE(run.out.find(c.message), std::string::npos) << c.args << "\n" << run.out;
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
