// grpc_echo_perf: gRPC C++ unary calls of examples/echo's echo.proto over TCP loopback, timed
// by the same harness as rpc_perf (bench/perf_common.h), so swirl's RPC has a peer measured
// the same way: the same .proto, message and service, the same cores, percentiles and JSON.
//
//   grpc_echo_perf -s 64 -n 20000 --json         # synchronous unary calls, one in flight
//   grpc_echo_perf -s 64 -D 2 --inflight 8       # 8 in flight (the async API), for 2 s
//   grpc_echo_perf --connections 1000            # connection setup: see RunConnections
//
// With neither --server nor --connect it starts the server itself (a second process pinned to
// --server_core; gRPC's synchronous server and its thread pool all run on that core) and runs
// the client pinned to --client_core (client thread t on --client_core + t). Each call is timed
// from its start to its completion: a round trip (rtt_*).

#include <limits.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/proc_status.h"
#include "bench/perf_common.h"
#include "examples/echo/echo.grpc.pb.h"
#include "examples/echo/echo.pb.h"

ABSL_FLAG(bool, server, false, "run only the server");
ABSL_FLAG(std::string, connect, "", "run only the client, against this host:port");
ABSL_FLAG(int, port, 0, "--server: the port (0: pick)");
ABSL_FLAG(std::string, port_file, "", "--server: write the chosen port here");
ABSL_FLAG(int, spawned_by, 0, "internal: the client process that started this server");
ABSL_FLAG(int, connections, 0,
          "instead of timing calls: open this many channels one after another, one call on "
          "each, all held open; report setups per second and memory per connection");

namespace swirl::bench {
namespace {

using examples::EchoRequest;
using examples::EchoResponse;

class GrpcEcho final : public examples::Echo::Service {
 public:
  grpc::Status Echo(grpc::ServerContext*, const EchoRequest* request,
                    EchoResponse* response) override {
    response->set_payload(request->payload());
    response->set_sequence(request->sequence());
    return grpc::Status::OK;
  }
};

void PinOrDie(int core, const char* who) {
  if (core < 0) return;
  std::string error;
  if (!PinToCore(core, &error)) {
    Die("cannot pin the %s to core %d: %s (give -1 to run it unpinned)", who, core,
        error.c_str());
  }
}

int RunServer() {
  if (const int parent = absl::GetFlag(FLAGS_spawned_by); parent > 0) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) return 1;
  }
  PinOrDie(ServerCore(), "server");  // before gRPC starts its threads, which inherit it
  // SIGTERM ends the server: blocked here, taken by sigwait below, so gRPC's threads never see
  // it as a fatal signal.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  GrpcEcho service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", absl::GetFlag(FLAGS_port)),
                           grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) Die("the gRPC server did not start");
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    const std::string path = absl::GetFlag(FLAGS_port_file);
    std::ofstream(path + ".tmp") << port << "\n";
    std::rename((path + ".tmp").c_str(), path.c_str());
  } else {
    std::printf("grpc_echo_perf server on port %d\n", port);
    std::fflush(stdout);
  }
  int signal = 0;
  sigwait(&stop_signals, &signal);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  return 0;
}

pid_t SpawnServer(int* port) {
  const std::string port_file = absl::StrCat("/tmp/grpc_echo_perf-port-", getpid());
  std::remove(port_file.c_str());
  const pid_t pid = SpawnSelf({"--server", "--port_file=" + port_file,
                               absl::StrCat("--spawned_by=", getpid()),
                               absl::StrCat("--server_core=", ServerCore())});
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
  Die("the gRPC server did not start within 30 s");
}

struct ThreadResult {
  Histogram rtt_ns;
  uint64_t calls = 0;
  uint64_t warmup = 0;
  double seconds = 0;
};

// One client thread: its own channel (a connection of its own), `inflight` calls at a time.
ThreadResult RunThread(const std::string& address, int t, uint64_t size) {
  const int core = ClientCore();
  if (core >= 0) {
    const int ncpu = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    PinOrDie((core + t) % ncpu, "client thread");
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // one connection per thread
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
    Die("cannot connect to the gRPC server at %s", address.c_str());
  }
  auto stub = examples::Echo::NewStub(channel);
  EchoRequest request;
  request.set_payload(std::string(size, 'x'));
  const int inflight = HarnessInflight(1);
  const double duration = HarnessDuration();
  const uint64_t iters = HarnessIters(20000);
  const int64_t warmup_flag = HarnessWarmupFlag();
  ThreadResult out;
  LatencyRecorder recorder;

  // Runs calls until `stop()` (checked between calls), recording each if `record`.
  auto run = [&](auto stop, bool record) {
    uint64_t done = 0;
    if (inflight == 1) {
      EchoResponse response;
      for (uint64_t i = 0; !stop(done); ++i) {
        grpc::ClientContext context;
        request.set_sequence(i);
        const uint64_t start = Ticks();
        grpc::Status s = stub->Echo(&context, request, &response);
        const uint64_t ticks = Ticks() - start;
        if (!s.ok()) Die("Echo: %s", s.error_message().c_str());
        if (response.sequence() != i || response.payload().size() != size) {
          Die("the echo came back wrong");
        }
        if (record) recorder.Add(ticks);
        ++done;
      }
      return done;
    }
    // `inflight` asynchronous calls on one completion queue; each completion starts the next.
    struct Call {
      grpc::ClientContext context;
      EchoResponse response;
      grpc::Status status;
      std::unique_ptr<grpc::ClientAsyncResponseReader<EchoResponse>> reader;
      uint64_t start = 0;
    };
    grpc::CompletionQueue cq;
    std::vector<std::unique_ptr<Call>> calls(inflight);
    auto start_call = [&](int slot) {
      calls[slot] = std::make_unique<Call>();
      Call& c = *calls[slot];
      c.start = Ticks();
      c.reader = stub->AsyncEcho(&c.context, request, &cq);
      c.reader->Finish(&c.response, &c.status, reinterpret_cast<void*>(static_cast<intptr_t>(slot)));
    };
    for (int i = 0; i < inflight; ++i) start_call(i);
    int outstanding = inflight;
    bool stopping = false;
    while (outstanding > 0) {
      void* tag;
      bool ok;
      if (!cq.Next(&tag, &ok)) Die("the completion queue shut down");
      const int slot = static_cast<int>(reinterpret_cast<intptr_t>(tag));
      Call& c = *calls[slot];
      const uint64_t ticks = Ticks() - c.start;
      if (!ok || !c.status.ok()) Die("AsyncEcho: %s", c.status.error_message().c_str());
      --outstanding;
      if (stopping) continue;  // calls finishing after the stop are not counted
      if (record) recorder.Add(ticks);
      ++done;
      if (stop(done)) {
        stopping = true;
      } else {
        start_call(slot);
        ++outstanding;
      }
    }
    cq.Shutdown();
    return done;
  };

  // Warm-up: --warmup calls, or (default) 1000 calls, or 10% of -D.
  if (duration > 0 && warmup_flag < 0) {
    const int64_t until = MonoNs() + static_cast<int64_t>(0.1 * duration * 1e9);
    out.warmup = run([&](uint64_t) { return MonoNs() >= until; }, false);
  } else {
    const uint64_t n = warmup_flag >= 0 ? static_cast<uint64_t>(warmup_flag) : 1000;
    out.warmup = n == 0 ? 0 : run([&](uint64_t done) { return done >= n; }, false);
  }
  const int64_t begin = MonoNs();
  const int64_t until = begin + static_cast<int64_t>(duration * 1e9);
  // -D: at least 100 calls, so a run the host stalled still has a distribution.
  out.calls = duration > 0 ? run([&](uint64_t done) { return MonoNs() >= until && done >= 100; },
                                 true)
                           : run([&](uint64_t done) { return done >= iters; }, true);
  out.seconds = static_cast<double>(MonoNs() - begin) / 1e9;
  out.rtt_ns = recorder.histogram();
  return out;
}

int RunClient(const std::string& address, Report& report) {
  TickClock::Init();
  const std::vector<uint64_t> sizes = HarnessSizes();
  if (sizes.size() != 1) Die("-a: grpc_echo_perf runs one size per run");
  const uint64_t size = sizes[0];
  const int threads = HarnessThreads();
  std::vector<ThreadResult> results(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] { results[t] = RunThread(address, t, size); });
  }
  for (auto& th : pool) th.join();
  ResultRow row;
  row.test = "grpc_unary";
  row.size = size;
  row.has_latency = true;
  double rate = 0;
  for (const ThreadResult& r : results) {
    row.rtt_ns.Merge(r.rtt_ns);
    row.iters += r.calls;
    row.warmup += r.warmup;
    row.seconds = std::max(row.seconds, r.seconds);
    if (r.seconds > 0) rate += static_cast<double>(r.calls) / r.seconds;
  }
  row.ops_per_s = rate;
  row.AddInt("depth", HarnessInflight(1));
  row.AddInt("threads", threads);
  row.Add("encoding", "protobuf");
  row.Add("transport", "TCP loopback (gRPC " + grpc::Version() + ")");
  row.notes.push_back(absl::StrCat("gRPC ", grpc::Version(), " unary echo over TCP loopback, ",
                                   HarnessInflight(1), " in flight per thread, ", threads,
                                   " thread(s)"));
  report.Row(std::move(row));
  return 0;
}

// Connection setup, as rpc/scale_test measures swirl's: `n` channels opened one after another
// from this thread, each its own TCP connection (a local subchannel pool), each answering one
// unary echo before the next is opened, and all of them held open to the end. A setup is timed
// from creating the channel to its first call's response. Prints the rate per quarter of the
// run; the row's latency is the time per setup. Memory per connection: the growth of each
// process's VmRSS after the first 10% of the connections, divided by the rest.
int RunConnections(const std::string& address, int n, pid_t server, Report& report) {
  TickClock::Init();
  if (n < 10) Die("--connections: at least 10");
  const int core = ClientCore();
  if (core >= 0) PinOrDie(core, "client");
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  channels.reserve(n);
  EchoRequest request;
  request.set_payload(std::string(64, 'x'));
  LatencyRecorder recorder;
  const int base_count = n / 10;
  int64_t client_base = 0, server_base = 0;
  const int64_t begin = MonoNs();
  int64_t quarter_begin = begin;
  int64_t measured_begin = begin;
  for (int i = 0; i < n; ++i) {
    if (i == base_count) {
      client_base = ResidentKib(0);
      server_base = server > 0 ? ResidentKib(server) : -1;
      measured_begin = MonoNs();
    }
    const uint64_t start = Ticks();
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    auto stub = examples::Echo::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    context.set_wait_for_ready(true);
    EchoResponse response;
    request.set_sequence(static_cast<uint64_t>(i));
    grpc::Status s = stub->Echo(&context, request, &response);
    if (!s.ok()) Die("connection %d: Echo: %s", i, s.error_message().c_str());
    if (response.sequence() != static_cast<uint64_t>(i)) Die("the echo came back wrong");
    recorder.Add(Ticks() - start);
    channels.push_back(std::move(channel));
    if ((i + 1) % (n / 4) == 0 && report.text()) {
      const int64_t now = MonoNs();
      std::printf(" %d held: %.0f setups/s over the last %d\n", i + 1,
                  (n / 4) * 1e9 / static_cast<double>(now - quarter_begin), n / 4);
      quarter_begin = now;
    }
  }
  const int64_t end = MonoNs();
  const int64_t client_kb = ResidentKib(0) - client_base;
  const int64_t server_kb = server > 0 ? ResidentKib(server) - server_base : -1;
  const int measured = n - base_count;
  ResultRow row;
  row.test = "grpc_connect";
  row.size = 64;
  row.has_latency = true;
  row.one_way_divisor = 1;
  row.rtt_ns = recorder.histogram();
  row.iters = static_cast<uint64_t>(n);
  row.seconds = static_cast<double>(end - begin) / 1e9;
  row.ops_per_s = measured * 1e9 / static_cast<double>(end - measured_begin);
  row.AddInt("connections", n);
  row.Add("client_kib_per_connection", static_cast<double>(client_kb) / measured);
  if (server_kb >= 0) row.Add("server_kib_per_connection", static_cast<double>(server_kb) / measured);
  row.Add("transport", "TCP loopback (gRPC " + grpc::Version() + ")");
  row.notes.push_back(absl::StrFormat(
      "gRPC %s: %d channels (a TCP connection each) opened one after another, one unary echo "
      "on each, all held; %.0f setups/s after the first %d; memory per connection: client "
      "%.1f KiB, server %s",
      grpc::Version(), n, row.ops_per_s, base_count, static_cast<double>(client_kb) / measured,
      server_kb >= 0 ? absl::StrFormat("%.1f KiB", static_cast<double>(server_kb) / measured)
                     : std::string("not measured (--connect)")));
  report.Row(std::move(row));
  return 0;
}

}  // namespace
}  // namespace swirl::bench

int main(int argc, char** argv) {
  using namespace swirl::bench;  // NOLINT
  ParseHarnessCommandLine(argc, argv,
                          "gRPC C++ unary echo (examples/echo/echo.proto) over TCP loopback.\n"
                          "  grpc_echo_perf [-s N] [-n N | -D S] [--inflight N] [--threads N]\n"
                          "                 [--json | --csv] [--out_json [--out_json_file F]] [-H]");
  std::signal(SIGPIPE, SIG_IGN);
  if (absl::GetFlag(FLAGS_server)) return RunServer();
  if (absl::GetFlag(FLAGS_connections) > 0) {
    // A socket per connection on each side (the server, spawned below, inherits the limit).
    rlimit limit;
    if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
      limit.rlim_cur = limit.rlim_max;
      setrlimit(RLIMIT_NOFILE, &limit);
    }
  }
  std::string address = absl::GetFlag(FLAGS_connect);
  pid_t server = -1;
  if (address.empty()) {
    int port = 0;
    server = SpawnServer(&port);
    address = absl::StrCat("127.0.0.1:", port);
  }
  Report report("grpc_echo_perf");
  report.SetContext({{"device", "\"tcp\""},
                     {"client_core", absl::StrCat(ClientCore())},
                     {"server_core", absl::StrCat(ServerCore())}});
  if (report.text()) Report::PrintLatencyHeader();
  const int connections = absl::GetFlag(FLAGS_connections);
  const int rc = connections > 0 ? RunConnections(address, connections, server, report)
                                 : RunClient(address, report);
  if (server > 0) {
    kill(server, SIGTERM);
    const int status = WaitChild(server, 10000);
    if (status != 0) Die("the gRPC server exited with status %d", status);
  }
  if (report.text()) {
    std::printf(" Left of '|' one-way = RTT/2 (perftest's convention); right of it the round trip "
                "(a call's latency).\n");
  }
  report.Finish();
  return rc;
}
