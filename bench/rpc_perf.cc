// rpc_perf: swirl RPC latency and throughput, in the conventions of bench/verbs_perf.
//
//   rpc_perf --test latency --size 64 --json          # 64-byte protobuf echo round trip
//   rpc_perf --test throughput --depth 32 --json      # pipelined async echo calls per second
//   rpc_perf --test bulk_read --size 1048576 --bulk_mode server-exposes --json
//   rpc_perf --test bulk_write --size 65536 --bulk_mode mirror --local_invalidation_only
//   rpc_perf --test bulk_read --size 65536 --compare server-exposes+local-inv --json  # in turns
//
// With neither --server nor --connect it starts the server itself in a second process pinned
// to --server_core (one worker) and runs the client on --client_core. --json prints one object
// with the keys of verbs_perf (rtt_min_us, rtt_p50_us, rtt_avg_us, rtt_p99_us, rtt_p999_us;
// ops_per_s, gbytes_per_s) plus the negotiated invalidation and bulk modes. docs/BENCHMARKS.md
// has the commands behind the published numbers.

#include <limits.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/perf_common.h"
#include "examples/echo/echo.swirl.h"
#include "examples/echo/echo_service.h"
#include "rpc/channel.h"
#include "rpc/server.h"
#include "rpc/wire.h"

ABSL_FLAG(std::string, test, "latency", "latency|throughput|bulk_read|bulk_write");
ABSL_FLAG(int, size, 64, "payload bytes (echo payload, or bulk transfer size)");
ABSL_FLAG(int, iters, 100000, "latency: round trips to time");
ABSL_FLAG(int, warmup, 5000, "latency: untimed round trips first");
ABSL_FLAG(double, seconds, 2.0, "throughput and bulk tests: how long to run");
ABSL_FLAG(int, depth, 16, "throughput and bulk tests: calls in flight");
ABSL_FLAG(std::string, bulk_mode, "server-exposes",
          "server-exposes|mirror");
ABSL_FLAG(bool, local_invalidation_only, false,
          "force the explicit local-invalidation fallback (measure it)");
ABSL_FLAG(std::string, compare, "",
          "bulk tests: also run this mode (a --bulk_mode value, optionally with \"+local-inv\") "
          "on a second channel, the two taking turns in --slice_ms slices; prints both and the "
          "median of the per-slice-pair ratios (this mode / that one)");
ABSL_FLAG(int, slice_ms, 100, "--compare: length of each turn");
ABSL_FLAG(int, client_core, 0, "CPU for the client (-1: don't pin)");
ABSL_FLAG(int, server_core, 1, "CPU for the server worker (-1: don't pin)");
ABSL_FLAG(bool, server, false, "run only the server (on --port)");
ABSL_FLAG(std::string, connect, "", "run only the client, against this host:port");
ABSL_FLAG(int, port, 0, "control-plane port for --server (0: pick)");
ABSL_FLAG(std::string, port_file, "", "--server: write the chosen port here");
ABSL_FLAG(int, spawned_by, 0, "internal: the client process that started this server");
ABSL_FLAG(std::string, device, "", "RDMA device (default: automatic)");
ABSL_FLAG(bool, json, false, "print one JSON object");
ABSL_FLAG(bool, raw, false,
          "latency/throughput: echo raw bytes (Service::AddRawMethod) instead of the protobuf "
          "EchoRequest, to separate protobuf's cost from swirl's");

namespace {

using swirl::bench::Ticks;
using swirl::bench::TickClock;

[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "rpc_perf: %s\n", what.c_str());
  std::exit(1);
}

using EchoImpl = swirl::examples::EchoServiceImpl;

// Bulk endpoints: Read answers with a bulk attachment of the requested size, Write takes one.
class BulkBench final : public swirl::Service {
 public:
  BulkBench() : Service("bench.Bulk") {
    AddRawMethod("Read", [](swirl::ServerContext& ctx, absl::string_view in,
                            swirl::ResponseWriter&) {
      size_t n = 0;
      if (!absl::SimpleAtoi(in, &n)) return absl::InvalidArgumentError("size");
      auto bulk = ctx.AllocateResponseBulk(n);
      if (!bulk.ok()) return bulk.status();
      (*bulk)->resize(n);  // contents are whatever the pool holds: the transfer is what counts
      return absl::OkStatus();
    });
    AddRawMethod("Echo", [](swirl::ServerContext&, absl::string_view in,
                            swirl::ResponseWriter& out) {
      return out.Append(in) ? absl::OkStatus() : absl::ResourceExhaustedError("too big");
    });
    AddRawMethod("Write", [](swirl::ServerContext& ctx, absl::string_view,
                             swirl::ResponseWriter& out) {
      swirl::BulkBuffer* in = ctx.request_bulk();
      if (in == nullptr) return absl::InvalidArgumentError("no bulk data");
      out.Append(std::to_string(in->size()));
      return absl::OkStatus();
    });
  }
};

int RunServer() {
  if (const int parent = absl::GetFlag(FLAGS_spawned_by); parent > 0) {
    // Started by a client (SpawnServer): go when it goes, however it ends. The check after
    // arming catches a client that ended before prctl.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) return 1;
  }
  if (int core = absl::GetFlag(FLAGS_server_core); core >= 0) {
    std::string error;
    if (!swirl::bench::PinToCore(core, &error)) {
      Fail(absl::StrCat("cannot pin the server to core ", core, ": ", error,
                        " (--server_core -1 runs it unpinned)"));
    }
  }
  swirl::ServerOptions options;
  options.address = absl::StrCat("127.0.0.1:", absl::GetFlag(FLAGS_port));
  options.transport.device = absl::GetFlag(FLAGS_device);
  options.worker_cores = {absl::GetFlag(FLAGS_server_core)};
  options.idle_spin = absl::Seconds(1);  // busy-poll: benchmarks measure the hot path
  options.transport.bulk_pool_bytes = 512 << 20;
  options.max_bulk_size = 64 << 20;
  options.window_credits = 32;
  options.transport.credits = 64;
  options.max_connections = 16;
  EchoImpl echo;
  BulkBench bulk;
  swirl::Server server(options);
  if (!server.RegisterService(&echo).ok() || !server.RegisterService(&bulk).ok()) return 1;
  if (auto s = server.Start(); !s.ok()) Fail(s.ToString());
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    const std::string path = absl::GetFlag(FLAGS_port_file);
    std::ofstream(path + ".tmp") << server.port() << "\n";
    std::rename((path + ".tmp").c_str(), path.c_str());
  } else {
    std::printf("rpc_perf server on port %d\n", server.port());
    std::fflush(stdout);
  }
  static std::atomic<bool> stop{false};
  struct sigaction sa {};
  sa.sa_handler = [](int) { stop.store(true); };
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  while (!stop.load()) pause();
  server.Shutdown(absl::Seconds(1));
  return 0;
}

std::string SelfPath() {
  char path[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) Fail("cannot find /proc/self/exe");
  path[n] = 0;
  return path;
}

pid_t SpawnServer(int* port) {
  const std::string port_file = absl::StrCat("/tmp/rpc_perf-port-", getpid());
  std::remove(port_file.c_str());
  std::vector<std::string> args = {SelfPath(),
                                   "--server",
                                   "--port_file=" + port_file,
                                   absl::StrCat("--spawned_by=", getpid()),
                                   absl::StrCat("--server_core=", absl::GetFlag(FLAGS_server_core)),
                                   "--device=" + absl::GetFlag(FLAGS_device)};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) {
    Fail("cannot start the server");
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    std::ifstream in(port_file);
    if (in >> *port && *port > 0) {
      std::remove(port_file.c_str());
      return pid;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  kill(pid, SIGKILL);
  Fail("the server did not start");
}

struct Result {
  std::vector<std::pair<std::string, std::string>> fields;
  void Add(const std::string& k, double v) { fields.push_back({k, absl::StrFormat("%.4f", v)}); }
  void Add(const std::string& k, const std::string& v) {
    fields.push_back({k, absl::StrCat("\"", v, "\"")});
  }
  std::string Json() const {
    std::string out = "{";
    for (size_t i = 0; i < fields.size(); ++i) {
      absl::StrAppend(&out, i ? "," : "", "\"", fields[i].first, "\":", fields[i].second);
    }
    return out + "}";
  }
};

// The bulk mode a --bulk_mode / --compare value names: "server-exposes" or "mirror", each
// optionally with "+local-inv" (local invalidation only).
swirl::ChannelOptions ParseMode(const std::string& spec, swirl::ChannelOptions options) {
  std::string mode = spec;
  options.transport.invalidation = swirl::InvalidationPolicy::kPreferRemote;
  if (absl::EndsWith(mode, "+local-inv")) {
    options.transport.invalidation = swirl::InvalidationPolicy::kLocalOnly;
    mode.resize(mode.size() - std::strlen("+local-inv"));
  }
  if (mode == "mirror") {
    options.bulk_mode = swirl::BulkMode::kMirror;
  } else if (mode == "server-exposes") {
    options.bulk_mode = swirl::BulkMode::kServerExposes;
  } else {
    Fail("unknown bulk mode " + spec);
  }
  return options;
}

// Window counters of this channel's connection, both ends: who revoked the windows is the
// point of the bulk modes, so the output shows it.
void AddWindowCounters(swirl::Channel& ch, const std::string& prefix, Result& result) {
  const auto local = ch.LocalStats();
  uint64_t remote = local.windows_remote_invalidated();
  uint64_t locally = local.windows_locally_invalidated();
  if (auto server = ch.ServerStats(); server.ok()) {
    for (const auto& c : server->connections()) {
      if (c.connection_id() != ch.connection_id()) continue;
      remote += c.windows_remote_invalidated();
      locally += c.windows_locally_invalidated();
    }
  }
  result.Add(prefix + "windows_remote_invalidated", static_cast<double>(remote));
  result.Add(prefix + "windows_locally_invalidated", static_cast<double>(locally));
}

// Linear interpolation between closest ranks (numpy's default) of sorted, non-empty `v`: the
// median of an even count is the mean of the two middle values, as Python's statistics.median.
double Quantile(const std::vector<double>& v, double q) {
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(pos);
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

// Keeps `depth` calls in flight on one channel from this thread, each restarted from its
// completion callback (on the thread that drives the channel, so restarted calls leave
// together with one doorbell per loop iteration).
class Pipeline {
 public:
  struct Slice {
    uint64_t calls = 0;  // completed within the time
    double seconds = 0;
  };

  Pipeline(swirl::Channel& ch, const std::string& test, int size, int depth, bool raw)
      : ch_(ch),
        stub_(ch),
        read_(test == "bulk_read"),
        write_(test == "bulk_write"),
        raw_(raw),
        size_text_(std::to_string(size)),
        raw_payload_(size, 'x'),
        calls_(depth),
        responses_(depth),
        buffers_(depth),
        raw_out_(depth) {
    request_.set_payload(std::string(size, 'x'));
    for (int i = 0; i < depth && (read_ || write_); ++i) {
      auto b = ch.AllocateBulk(size);
      if (!b.ok()) Fail(b.status().ToString());
      buffers_[i] = std::move(*b);
      buffers_[i].resize(size);
    }
  }

  // Starts every call, polls for `ns`, then lets the calls in flight finish uncounted.
  Slice Run(int64_t ns) {
    done_ = 0;
    running_ = true;
    for (size_t i = 0; i < calls_.size(); ++i) Start(i);
    const int64_t begin = swirl::bench::MonoNs();
    const int64_t end = begin + ns;
    int64_t now = begin;
    uint64_t spins = 0;
    while (now < end) {
      ch_.Poll();
      if ((++spins & 15) == 0) now = swirl::bench::MonoNs();
    }
    Slice slice{done_, static_cast<double>(now - begin) / 1e9};
    running_ = false;
    while (in_flight_ > 0) ch_.Poll();
    return slice;
  }

 private:
  void Start(size_t i) {
    ++in_flight_;
    calls_[i].SetCallback([this, i](absl::Status status) {
      if (!status.ok()) Fail(status.ToString());
      ++done_;
      --in_flight_;
      if (running_) Start(i);
    });
    if (read_ || write_) {
      swirl::CallOptions co;
      if (read_) co.response_bulk = &buffers_[i];
      if (write_) co.request_bulk = &buffers_[i];
      calls_[i].SetMethod(read_ ? kReadId : kWriteId);
      calls_[i].SetRequestBytes(size_text_);
      calls_[i].SetResponseBytes(&raw_out_[i]);
      calls_[i].SetOptions(co);
      ch_.Start(&calls_[i]);
    } else if (raw_) {
      calls_[i].SetMethod(kEchoId);
      calls_[i].SetRequestBytes(raw_payload_);
      calls_[i].SetResponseBytes(&raw_out_[i]);
      calls_[i].SetOptions({});
      ch_.Start(&calls_[i]);
    } else {
      stub_.AsyncEcho(&calls_[i], request_, &responses_[i]);
    }
  }

  inline static const uint32_t kReadId = swirl::rpc_wire::MethodId("/bench.Bulk/Read");
  inline static const uint32_t kWriteId = swirl::rpc_wire::MethodId("/bench.Bulk/Write");
  inline static const uint32_t kEchoId = swirl::rpc_wire::MethodId("/bench.Bulk/Echo");

  swirl::Channel& ch_;
  swirl::examples::EchoStub stub_;
  const bool read_, write_, raw_;
  const std::string size_text_;
  const std::string raw_payload_;
  swirl::examples::EchoRequest request_;
  std::vector<swirl::ClientCall> calls_;
  std::vector<swirl::examples::EchoResponse> responses_;
  std::vector<swirl::BulkBuffer> buffers_;
  std::vector<std::string> raw_out_;
  uint64_t done_ = 0;
  int in_flight_ = 0;
  bool running_ = false;
};

int RunClient(const std::string& address, Result& result) {
  if (int core = absl::GetFlag(FLAGS_client_core); core >= 0) {
    std::string error;
    if (!swirl::bench::PinToCore(core, &error)) {
      Fail(absl::StrCat("cannot pin the client to core ", core, ": ", error,
                        " (--client_core -1 runs it unpinned)"));
    }
  }
  TickClock::Init();
  swirl::ChannelOptions options;
  options.driver = swirl::ChannelOptions::Driver::kCaller;
  options.transport.device = absl::GetFlag(FLAGS_device);
  options.transport.credits = 64;
  options.transport.bulk_pool_bytes = 512 << 20;
  options = ParseMode(absl::GetFlag(FLAGS_bulk_mode), options);
  if (absl::GetFlag(FLAGS_local_invalidation_only)) {
    options.transport.invalidation = swirl::InvalidationPolicy::kLocalOnly;
  }
  auto channel = swirl::Channel::Create(address, options);
  if (!channel.ok()) Fail(channel.status().ToString());
  swirl::Channel& ch = **channel;
  const std::string test = absl::GetFlag(FLAGS_test);
  const int size = absl::GetFlag(FLAGS_size);
  result.Add("test", test);
  result.Add("size", size);
  result.Add("invalidation", swirl::control::InvalidationMode_Name(ch.negotiated().invalidation()));
  result.Add("bulk_mode", swirl::control::BulkMode_Name(ch.negotiated().bulk_mode()));
  swirl::examples::EchoStub stub(ch);
  swirl::examples::EchoRequest request;
  request.set_payload(std::string(size, 'x'));
  swirl::examples::EchoResponse response;

  const bool raw = absl::GetFlag(FLAGS_raw);
  result.Add("encoding", raw ? "raw" : "protobuf");
  const uint32_t raw_echo_id = swirl::rpc_wire::MethodId("/bench.Bulk/Echo");
  const std::string raw_payload(size, 'x');
  std::string raw_response;
  if (test == "latency") {
    const int iters = absl::GetFlag(FLAGS_iters);
    auto echo = [&] {
      return raw ? swirl::CallRaw(ch, raw_echo_id, raw_payload, &raw_response, {})
                 : stub.Echo(request, &response);
    };
    for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
      if (auto s = echo(); !s.ok()) Fail(s.ToString());
    }
    // What is timed must be a real echo: checked once, outside the timed loop.
    if (raw ? raw_response != raw_payload : response.payload() != request.payload()) {
      Fail("the echo came back wrong");
    }
    std::vector<uint64_t> samples(iters);
    for (int i = 0; i < iters; ++i) {
      const uint64_t start = Ticks();
      absl::Status s = echo();
      samples[i] = Ticks() - start;
      if (!s.ok()) Fail(s.ToString());
    }
    auto stats = swirl::bench::ComputeLatency(samples, TickClock::TicksPerUs());
    result.Add("iters", iters);
    result.Add("rtt_min_us", stats.min_us);
    result.Add("rtt_p50_us", stats.p50_us);
    result.Add("rtt_avg_us", stats.avg_us);
    result.Add("rtt_p99_us", stats.p99_us);
    result.Add("rtt_p999_us", stats.p999_us);
    return 0;
  }

  // Pipelined tests.
  const int depth = absl::GetFlag(FLAGS_depth);
  const bool bulk = test == "bulk_read" || test == "bulk_write";
  if (!bulk && test != "throughput") Fail("unknown --test " + test);
  const std::string compare = absl::GetFlag(FLAGS_compare);
  if (!compare.empty() && !bulk) Fail("--compare is for the bulk tests");
  Pipeline main_pipe(ch, test, size, depth, raw);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  result.Add("depth", depth);
  if (compare.empty()) {
    // One untimed slice first (as --compare has): pools touched, the worker awake.
    (void)main_pipe.Run(100 * 1000 * 1000);
    const Pipeline::Slice run = main_pipe.Run(static_cast<int64_t>(seconds * 1e9));
    result.Add("seconds", run.seconds);
    result.Add("ops_per_s", static_cast<double>(run.calls) / run.seconds);
    if (bulk) {
      result.Add("gbytes_per_s", static_cast<double>(run.calls) * size / run.seconds / 1e9);
      AddWindowCounters(ch, "", result);
    }
    return 0;
  }

  // --compare: a second channel to the same server in the other mode, and the two take turns
  // in short slices (A B, B A, A B, ...). This machine changes speed by several times within
  // seconds; slices of the two modes close together see the same machine, and the median of
  // the per-pair ratios is what the comparison rests on.
  auto other = swirl::Channel::Create(address, ParseMode(compare, options));
  if (!other.ok()) Fail(other.status().ToString());
  swirl::Channel& och = **other;
  result.Add("compare", compare);
  result.Add("compare_invalidation",
             swirl::control::InvalidationMode_Name(och.negotiated().invalidation()));
  result.Add("compare_bulk_mode", swirl::control::BulkMode_Name(och.negotiated().bulk_mode()));
  Pipeline other_pipe(och, test, size, depth, raw);
  const int64_t slice_ns = absl::GetFlag(FLAGS_slice_ms) * 1000000LL;
  const int pairs = static_cast<int>(std::clamp(seconds * 1e9 / (2.0 * slice_ns), 1.0, 1e6));
  // One unmeasured slice of each first: the first turn of either must not be the cold one.
  main_pipe.Run(slice_ns);
  other_pipe.Run(slice_ns);
  double main_s = 0, other_s = 0;
  uint64_t main_calls = 0, other_calls = 0;
  std::vector<double> ratios;
  for (int i = 0; i < pairs; ++i) {
    Pipeline::Slice a, b;
    if (i % 2 == 0) {
      a = main_pipe.Run(slice_ns);
      b = other_pipe.Run(slice_ns);
    } else {
      b = other_pipe.Run(slice_ns);
      a = main_pipe.Run(slice_ns);
    }
    main_s += a.seconds;
    other_s += b.seconds;
    main_calls += a.calls;
    other_calls += b.calls;
    const double rate_a = a.calls / a.seconds, rate_b = b.calls / b.seconds;
    if (rate_b > 0) ratios.push_back(rate_a / rate_b);
  }
  if (ratios.empty() || main_calls == 0 || other_calls == 0) {
    Fail("--compare: a mode completed no calls in its slices; no ratio to report");
  }
  std::sort(ratios.begin(), ratios.end());
  result.Add("seconds", main_s);
  result.Add("ops_per_s", static_cast<double>(main_calls) / main_s);
  result.Add("gbytes_per_s", static_cast<double>(main_calls) * size / main_s / 1e9);
  result.Add("compare_ops_per_s", static_cast<double>(other_calls) / other_s);
  result.Add("compare_gbytes_per_s", static_cast<double>(other_calls) * size / other_s / 1e9);
  result.Add("slices", 2.0 * pairs);
  result.Add("ratio_median", Quantile(ratios, 0.5));
  result.Add("ratio_p10", Quantile(ratios, 0.1));
  result.Add("ratio_p90", Quantile(ratios, 0.9));
  AddWindowCounters(ch, "", result);
  AddWindowCounters(och, "compare_", result);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_server)) return RunServer();
  // Bad arguments fail here, before there is a server to clean up.
  if (!(absl::GetFlag(FLAGS_seconds) > 0)) Fail("--seconds must be positive");
  if (absl::GetFlag(FLAGS_slice_ms) <= 0) Fail("--slice_ms must be positive");
  if (absl::GetFlag(FLAGS_depth) <= 0) Fail("--depth must be positive");
  if (absl::GetFlag(FLAGS_iters) <= 0) Fail("--iters must be positive");
  (void)ParseMode(absl::GetFlag(FLAGS_bulk_mode), {});
  if (!absl::GetFlag(FLAGS_compare).empty()) (void)ParseMode(absl::GetFlag(FLAGS_compare), {});
  std::string address = absl::GetFlag(FLAGS_connect);
  pid_t server = -1;
  if (address.empty()) {
    int port = 0;
    server = SpawnServer(&port);
    address = absl::StrCat("127.0.0.1:", port);
  }
  Result result;
  result.Add("device", absl::GetFlag(FLAGS_device).empty() ? "auto" : absl::GetFlag(FLAGS_device));
  int rc = RunClient(address, result);
  if (server > 0) {
    kill(server, SIGTERM);
    waitpid(server, nullptr, 0);
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", result.Json().c_str());
  } else {
    for (auto& [k, v] : result.fields) std::printf("%-28s %s\n", k.c_str(), v.c_str());
  }
  return rc;
}
