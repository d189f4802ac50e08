// rpc_perf: swirl RPC latency and throughput, in the conventions of bench/verbs_perf (the
// shared harness's flags: bench/perf_common.h).
//
//   rpc_perf --test latency -s 64 --json              # 64-byte protobuf echo round trip
//   rpc_perf --test latency --raw -D 2 -H             # raw-bytes echo for 2 s, whole histogram
//   rpc_perf --test throughput --inflight 32 --json   # pipelined async echo calls per second
//   rpc_perf --test bulk_read -s 1048576 --bulk_mode server-exposes --json
//   rpc_perf --test bulk_write -s 65536 --bulk_mode mirror --local_invalidation_only
//   rpc_perf --test bulk_read -s 65536 --compare server-exposes+local-inv --json  # in turns
//
// With neither --server nor --connect it starts the server itself in a second process pinned
// to --server_core (one worker per client thread) and runs the client on --client_core
// (thread t on --client_core + t). Every test times each call from its start to its
// completion (rtt_*, a round trip: request out, response in); the latency test keeps one call
// in flight (a synchronous call) unless --inflight says more, the others keep --inflight
// (alias --depth, default 16) in flight for --seconds (or -D). --json prints one object with
// the keys of verbs_perf (rtt_*, perftest's t_*, ops_per_s, gbytes_per_s, the histogram) plus
// the negotiated invalidation and bulk modes. docs/BENCHMARKS.md has the commands.

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
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/perf_common.h"
#include "examples/echo/echo.swirl.h"
#include "examples/echo/echo_service.h"
#include "rpc/wire.h"
#include "swirl/channel.h"
#include "swirl/server.h"

ABSL_FLAG(std::string, test, "latency", "latency|throughput|bulk_read|bulk_write");
ABSL_FLAG(double, seconds, 2.0, "throughput and bulk tests: how long to run (-D overrides)");
ABSL_FLAG(int, depth, 0,
          "calls in flight (the older name of --inflight; 0: --inflight)");
ABSL_FLAG(std::string, bulk_mode, "server-exposes",
          "server-exposes|mirror");
ABSL_FLAG(bool, local_invalidation_only, false,
          "force the explicit local-invalidation fallback (measure it)");
ABSL_FLAG(std::string, compare, "",
          "bulk tests: also run this mode (a --bulk_mode value, optionally with \"+local-inv\") "
          "on a second channel, the two taking turns in --slice_ms slices; prints both and the "
          "median of the per-slice-pair ratios (this mode / that one)");
ABSL_FLAG(int, slice_ms, 100, "--compare: length of each turn");
ABSL_FLAG(bool, server, false, "run only the server (on --port)");
ABSL_FLAG(std::string, connect, "", "run only the client, against this host:port");
ABSL_FLAG(int, port, 0, "control-plane port for --server (0: pick)");
ABSL_FLAG(std::string, port_file, "", "--server: write the chosen port here");
ABSL_FLAG(int, spawned_by, 0, "internal: the client process that started this server");
ABSL_FLAG(std::string, device, "", "RDMA device (default: automatic)");
ABSL_FLAG(int, workers, 0, "--server: worker threads (0: one per client thread, --threads)");
ABSL_FLAG(bool, raw, false,
          "latency/throughput: echo raw bytes (Service::AddRawMethod) instead of the protobuf "
          "EchoRequest, to separate protobuf's cost from swirl's");

namespace {

using swirl::Histogram;
using swirl::bench::LatencyRecorder;
using swirl::bench::MeasuredSpan;
using swirl::bench::Report;
using swirl::bench::ResultRow;
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
  const int core = swirl::bench::ServerCore();
  if (core >= 0) {
    std::string error;
    if (!swirl::bench::PinToCore(core, &error)) {
      Fail(absl::StrCat("cannot pin the server to core ", core, ": ", error,
                        " (--server_core -1 runs it unpinned)"));
    }
  }
  swirl::ServerOptions options;
  options.address = absl::StrCat("127.0.0.1:", absl::GetFlag(FLAGS_port));
  options.transport.device = absl::GetFlag(FLAGS_device);
  const int workers = std::max(1, absl::GetFlag(FLAGS_workers) > 0 ? absl::GetFlag(FLAGS_workers)
                                                                   : swirl::bench::HarnessThreads());
  options.worker_cores.clear();
  const int ncpu = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int w = 0; w < workers; ++w) options.worker_cores.push_back(core < 0 ? -1 : (core + w) % ncpu);
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
                                   absl::StrCat("--server_core=", swirl::bench::ServerCore()),
                                   absl::StrCat("--workers=", swirl::bench::HarnessThreads()),
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
void AddWindowCounters(swirl::Channel& ch, const std::string& prefix, ResultRow& row) {
  const auto local = ch.LocalStats();
  uint64_t remote = local.windows_remote_invalidated;
  uint64_t locally = local.windows_locally_invalidated;
  if (auto server = ch.ServerStats(); server.ok()) {
    for (const auto& c : server->connections) {
      if (c.connection_id != ch.connection_id()) continue;
      remote += c.windows_remote_invalidated;
      locally += c.windows_locally_invalidated;
    }
  }
  row.AddInt(prefix + "windows_remote_invalidated", static_cast<int64_t>(remote));
  row.AddInt(prefix + "windows_locally_invalidated", static_cast<int64_t>(locally));
  row.notes.push_back(absl::StrFormat("%swindows revoked by the peer's SEND_WITH_INV: %d, by "
                                      "LOCAL_INV: %d",
                                      prefix, remote, locally));
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
// together with one doorbell per loop iteration). Each call's latency (start to completion)
// goes into the recorder while `timed`.
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
        started_(depth),
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

  // Starts every call, polls for `ns` (and until `min_calls` have completed), then lets the
  // calls in flight finish uncounted. With `recorder`, each call completed within the time
  // adds its latency.
  Slice Run(int64_t ns, LatencyRecorder* recorder = nullptr, uint64_t min_calls = 0) {
    done_ = 0;
    running_ = true;
    recorder_ = recorder;
    for (size_t i = 0; i < calls_.size(); ++i) Start(i);
    const int64_t begin = swirl::bench::MonoNs();
    const int64_t end = begin + ns;
    int64_t now = begin;
    uint64_t spins = 0;
    while (now < end || done_ < min_calls) {
      ch_.Poll();
      if ((++spins & 15) == 0) now = swirl::bench::MonoNs();
    }
    Slice slice{done_, static_cast<double>(now - begin) / 1e9};
    running_ = false;
    recorder_ = nullptr;
    while (in_flight_ > 0) ch_.Poll();
    return slice;
  }

 private:
  void Start(size_t i) {
    ++in_flight_;
    calls_[i].SetCallback([this, i](absl::Status status) {
      if (!status.ok()) Fail(status.ToString());
      if (!running_) {
        --in_flight_;
        return;
      }
      ++done_;
      --in_flight_;
      // A flush (one in 64 Ki calls) lands inside the other calls in flight: a pipelined
      // latency counts it as the machine's, as it would any other pause of this thread.
      if (recorder_ != nullptr) recorder_->Add(Ticks() - started_[i]);
      Start(i);
    });
    started_[i] = Ticks();
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
  std::vector<uint64_t> started_;
  std::vector<swirl::examples::EchoResponse> responses_;
  std::vector<swirl::BulkBuffer> buffers_;
  std::vector<std::string> raw_out_;
  LatencyRecorder* recorder_ = nullptr;
  uint64_t done_ = 0;
  int in_flight_ = 0;
  bool running_ = false;
};

// Calls in flight: --depth (the older name), else --inflight, else 1 for the latency test and
// 16 for the others.
int Depth() {
  if (absl::GetFlag(FLAGS_depth) > 0) return absl::GetFlag(FLAGS_depth);
  return swirl::bench::HarnessInflight(absl::GetFlag(FLAGS_test) == "latency" ? 1 : 16);
}

double Seconds() {
  const double d = swirl::bench::HarnessDuration();
  return d > 0 ? d : absl::GetFlag(FLAGS_seconds);
}

// One client thread's test on its own channel. Thread 0 also fills in the row's keys.
struct ThreadResult {
  Histogram rtt_ns;
  uint64_t calls = 0;
  uint64_t warmup = 0;
  double seconds = 0;
};

std::shared_ptr<swirl::Channel> Connect(const std::string& address, const std::string& mode) {
  swirl::ChannelOptions options;
  options.driver = swirl::ChannelOptions::Driver::kCaller;
  options.transport.device = absl::GetFlag(FLAGS_device);
  options.transport.credits = 64;
  options.transport.bulk_pool_bytes = 512 << 20;
  options = ParseMode(mode, options);
  if (absl::GetFlag(FLAGS_local_invalidation_only)) {
    options.transport.invalidation = swirl::InvalidationPolicy::kLocalOnly;
  }
  auto channel = swirl::Channel::Create(address, options);
  if (!channel.ok()) Fail(channel.status().ToString());
  return *channel;
}

void PinClientThread(int t) {
  const int core = swirl::bench::ClientCore();
  if (core < 0) return;
  const int ncpu = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string error;
  if (!swirl::bench::PinToCore((core + t) % ncpu, &error)) {
    Fail(absl::StrCat("cannot pin client thread ", t, " to core ", (core + t) % ncpu, ": ",
                      error, " (--client_core -1 runs it unpinned)"));
  }
}

// The latency or pipelined test on `ch` from this thread.
ThreadResult RunOne(swirl::Channel& ch, const std::string& test, int size) {
  ThreadResult out;
  const bool raw = absl::GetFlag(FLAGS_raw);
  LatencyRecorder recorder;
  if (test == "latency" && Depth() == 1) {
    swirl::examples::EchoStub stub(ch);
    swirl::examples::EchoRequest request;
    request.set_payload(std::string(size, 'x'));
    swirl::examples::EchoResponse response;
    const uint32_t raw_echo_id = swirl::rpc_wire::MethodId("/bench.Bulk/Echo");
    const std::string raw_payload(size, 'x');
    std::string raw_response;
    auto echo = [&] {
      return raw ? swirl::CallRaw(ch, raw_echo_id, raw_payload, &raw_response, {})
                 : stub.Echo(request, &response);
    };
    const double duration = swirl::bench::HarnessDuration();
    const uint64_t iters = swirl::bench::HarnessIters(100000);
    const int64_t warmup_flag = swirl::bench::HarnessWarmupFlag();
    // Count mode: --warmup (default 5000); duration mode: --warmup if given, else 10% of -D.
    if (duration > 0 && warmup_flag < 0) {
      const int64_t until = swirl::bench::MonoNs() + static_cast<int64_t>(0.1 * duration * 1e9);
      while (swirl::bench::MonoNs() < until) {
        if (auto s = echo(); !s.ok()) Fail(s.ToString());
        ++out.warmup;
      }
    } else {
      out.warmup = warmup_flag >= 0 ? static_cast<uint64_t>(warmup_flag) : 5000;
      for (uint64_t i = 0; i < out.warmup; ++i) {
        if (auto s = echo(); !s.ok()) Fail(s.ToString());
      }
    }
    // What is timed must be a real echo: checked once, outside the timed loop.
    if (auto s = echo(); !s.ok()) Fail(s.ToString());
    if (raw ? raw_response != raw_payload : response.payload() != request.payload()) {
      Fail("the echo came back wrong");
    }
    // -D counts measured time (what "seconds" reports), not the wall clock.
    MeasuredSpan span(duration > 0 ? duration : 0);
    uint64_t timed_ticks = 0;
    for (uint64_t i = 0;; ++i) {
      // -D: at least 100 calls, so a run the host stalled still has a distribution.
      if (duration > 0 ? i >= 100 && span.Covered(timed_ticks) : i >= iters) break;
      const uint64_t start = Ticks();
      absl::Status s = echo();
      const uint64_t t = Ticks() - start;
      if (!s.ok()) Fail(s.ToString());
      timed_ticks += t;
      recorder.Add(t);
      ++out.calls;
    }
    out.seconds = static_cast<double>(timed_ticks) / TickClock::TicksPerUs() / 1e6;
    out.rtt_ns = recorder.histogram();
    return out;
  }
  Pipeline pipe(ch, test, size, Depth(), raw);
  // One untimed slice first (as --compare has): pools touched, the worker awake.
  (void)pipe.Run(100 * 1000 * 1000);
  // At least 100 calls, so a run the host stalled still has a distribution.
  const Pipeline::Slice run = pipe.Run(static_cast<int64_t>(Seconds() * 1e9), &recorder, 100);
  out.calls = run.calls;
  out.seconds = run.seconds;
  out.rtt_ns = recorder.histogram();
  return out;
}

int RunClient(const std::string& address, Report& report) {
  TickClock::Init();
  const std::string test = absl::GetFlag(FLAGS_test);
  const int size = static_cast<int>(swirl::bench::HarnessSizes()[0]);
  const bool bulk = test == "bulk_read" || test == "bulk_write";
  if (!bulk && test != "throughput" && test != "latency") Fail("unknown --test " + test);
  const std::string compare = absl::GetFlag(FLAGS_compare);
  if (!compare.empty() && !bulk) Fail("--compare is for the bulk tests");
  const int threads = swirl::bench::HarnessThreads();
  if (!compare.empty() && threads != 1) Fail("--compare runs on one thread");

  ResultRow row;
  row.test = test;
  row.size = static_cast<uint64_t>(size);
  const bool raw = absl::GetFlag(FLAGS_raw);

  if (compare.empty()) {
    // Each thread connects, runs, and keeps its channel until all are done (the window
    // counters are read afterwards).
    std::vector<std::shared_ptr<swirl::Channel>> channels(threads);
    std::vector<ThreadResult> results(threads);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        PinClientThread(t);
        channels[t] = Connect(address, absl::GetFlag(FLAGS_bulk_mode));
        results[t] = RunOne(*channels[t], test, size);
      });
    }
    for (auto& th : pool) th.join();
    swirl::Channel& ch = *channels[0];
    row.Add("invalidation", swirl::ControlPlaneName(ch.negotiated().invalidation));
    row.Add("bulk_mode", swirl::ControlPlaneName(ch.negotiated().bulk_mode));
    row.Add("encoding", raw ? "raw" : "protobuf");
    row.AddInt("threads", threads);
    uint64_t calls = 0, warmup = 0;
    double seconds = 0, rate = 0;
    for (const ThreadResult& r : results) {
      row.rtt_ns.Merge(r.rtt_ns);
      calls += r.calls;
      warmup += r.warmup;
      seconds = std::max(seconds, r.seconds);
      if (r.seconds > 0) rate += static_cast<double>(r.calls) / r.seconds;
    }
    row.iters = calls;
    row.warmup = warmup;
    row.seconds = seconds;
    row.has_latency = calls > 0;
    row.ops_per_s = rate;
    row.AddInt("depth", Depth());
    if (bulk) {
      row.bytes_per_s = rate * size;
      for (int t = 0; t < threads; ++t) {
        AddWindowCounters(*channels[t], t == 0 ? "" : absl::StrCat("thread", t, "_"), row);
      }
    }
    row.notes.push_back(absl::StrFormat(
        "%s, %s, invalidation %s, bulk mode %s, %d in flight per thread, %d thread(s)",
        test, raw ? "raw bytes" : "protobuf",
        swirl::ControlPlaneName(ch.negotiated().invalidation),
        swirl::ControlPlaneName(ch.negotiated().bulk_mode),
        Depth(), threads));
    report.Row(std::move(row));
    return 0;
  }

  // --compare: a second channel to the same server in the other mode, and the two take turns
  // in short slices (A B, B A, A B, ...). This machine changes speed by several times within
  // seconds; slices of the two modes close together see the same machine, and the median of
  // the per-pair ratios is what the comparison rests on.
  PinClientThread(0);
  auto main_channel = Connect(address, absl::GetFlag(FLAGS_bulk_mode));
  swirl::Channel& ch = *main_channel;
  auto other = Connect(address, compare);
  // The compared mode is exactly what --compare says (not --local_invalidation_only).
  swirl::Channel& och = *other;
  row.Add("invalidation", swirl::ControlPlaneName(ch.negotiated().invalidation));
  row.Add("bulk_mode", swirl::ControlPlaneName(ch.negotiated().bulk_mode));
  row.Add("encoding", raw ? "raw" : "protobuf");
  row.Add("compare", compare);
  row.Add("compare_invalidation",
          swirl::ControlPlaneName(och.negotiated().invalidation));
  row.Add("compare_bulk_mode", swirl::ControlPlaneName(och.negotiated().bulk_mode));
  const int depth = Depth();
  row.AddInt("depth", depth);
  Pipeline main_pipe(ch, test, size, depth, raw);
  Pipeline other_pipe(och, test, size, depth, raw);
  const int64_t slice_ns = absl::GetFlag(FLAGS_slice_ms) * 1000000LL;
  const int pairs = static_cast<int>(std::clamp(Seconds() * 1e9 / (2.0 * slice_ns), 1.0, 1e6));
  // One unmeasured slice of each first: the first turn of either must not be the cold one.
  main_pipe.Run(slice_ns);
  other_pipe.Run(slice_ns);
  double main_s = 0, other_s = 0;
  uint64_t main_calls = 0, other_calls = 0;
  std::vector<double> ratios;
  LatencyRecorder main_rec, other_rec;
  for (int i = 0; i < pairs; ++i) {
    Pipeline::Slice a, b;
    if (i % 2 == 0) {
      a = main_pipe.Run(slice_ns, &main_rec);
      b = other_pipe.Run(slice_ns, &other_rec);
    } else {
      b = other_pipe.Run(slice_ns, &other_rec);
      a = main_pipe.Run(slice_ns, &main_rec);
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
  row.iters = main_calls;
  row.seconds = main_s;
  row.has_latency = true;
  row.rtt_ns = main_rec.histogram();
  row.ops_per_s = static_cast<double>(main_calls) / main_s;
  row.bytes_per_s = static_cast<double>(main_calls) * size / main_s;
  const swirl::bench::LatencyStats other_lat = swirl::bench::StatsOf(other_rec.histogram());
  row.Add("compare_ops_per_s", static_cast<double>(other_calls) / other_s);
  row.Add("compare_gbytes_per_s", static_cast<double>(other_calls) * size / other_s / 1e9);
  row.Add("compare_rtt_p50_us", other_lat.p50_us);
  row.Add("compare_rtt_p99_us", other_lat.p99_us);
  row.AddInt("slices", 2 * pairs);
  row.Add("ratio_median", Quantile(ratios, 0.5));
  row.Add("ratio_p10", Quantile(ratios, 0.1));
  row.Add("ratio_p90", Quantile(ratios, 0.9));
  row.notes.push_back(absl::StrFormat(
      "%s vs %s in %d alternating %d ms slices: throughput ratio median %.3f (p10 %.3f, p90 "
      "%.3f); that mode %.3f GB/s",
      absl::GetFlag(FLAGS_bulk_mode), compare, 2 * pairs, absl::GetFlag(FLAGS_slice_ms),
      Quantile(ratios, 0.5), Quantile(ratios, 0.1), Quantile(ratios, 0.9),
      static_cast<double>(other_calls) * size / other_s / 1e9));
  AddWindowCounters(ch, "", row);
  AddWindowCounters(och, "compare_", row);
  report.Row(std::move(row));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  swirl::bench::ParseHarnessCommandLine(
      argc, argv,
      "swirl RPC latency, throughput and bulk transfers.\n"
      "  rpc_perf --test latency|throughput|bulk_read|bulk_write [-s N] [-n N | -D S]\n"
      "           [--inflight N] [--threads N] [--raw] [--bulk_mode M] [--compare M]\n"
      "           [--json | --csv] [--out_json [--out_json_file F]] [-H]");
  if (absl::GetFlag(FLAGS_server)) return RunServer();
  // Bad arguments fail here, before there is a server to clean up.
  if (!(absl::GetFlag(FLAGS_seconds) > 0)) Fail("--seconds must be positive");
  if (absl::GetFlag(FLAGS_slice_ms) <= 0) Fail("--slice_ms must be positive");
  if (absl::GetFlag(FLAGS_depth) < 0) Fail("--depth must be positive");
  const std::vector<uint64_t> sizes = swirl::bench::HarnessSizes();
  if (sizes.size() != 1) Fail("-a: rpc_perf runs one size per run (bench/swirl_bench.py sweeps)");
  if (sizes[0] == 0 || sizes[0] > (64u << 20)) Fail("--size must be 1 .. 64 MiB");
  (void)ParseMode(absl::GetFlag(FLAGS_bulk_mode), {});
  if (!absl::GetFlag(FLAGS_compare).empty()) (void)ParseMode(absl::GetFlag(FLAGS_compare), {});
  std::string address = absl::GetFlag(FLAGS_connect);
  pid_t server = -1;
  if (address.empty()) {
    int port = 0;
    server = SpawnServer(&port);
    address = absl::StrCat("127.0.0.1:", port);
  }
  Report report("rpc_perf");
  report.SetContext({{"device", absl::StrCat("\"",
                                             swirl::bench::JsonEscape(
                                                 absl::GetFlag(FLAGS_device).empty()
                                                     ? "auto"
                                                     : absl::GetFlag(FLAGS_device)),
                                             "\"")},
                     {"client_core", absl::StrCat(swirl::bench::ClientCore())},
                     {"server_core", absl::StrCat(swirl::bench::ServerCore())}});
  if (report.text()) Report::PrintLatencyHeader();
  int rc = RunClient(address, report);
  if (server > 0) {
    kill(server, SIGTERM);
    waitpid(server, nullptr, 0);
  }
  if (report.text()) {
    std::printf(" Left of '|' one-way = RTT/2 (perftest's convention); right of it the round trip "
                "(a call's latency).\n");
  }
  report.Finish();
  return rc;
}
