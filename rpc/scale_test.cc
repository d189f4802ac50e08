// One server worker holding many connections (docs/RELIABILITY.md "Scale"): a client opens
// channels one after another on one runtime, one call on each, then a second call on every
// one. Before credits came from a shared pool, a worker's 16,384-entry SRQ held 32 reserved
// credits per connection and admitted at most 509 ("every worker is full").

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/proc_status.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "rpc/testing/e2e.h"
#include "rpc/testing/process.h"
#include "swirl/channel.h"
#include "swirl/client_runtime.h"

namespace swirl::testing {
namespace {

// What the old reservation admitted on one worker of the soft device.
constexpr int kOldLimit = 509;
// 1,000 by default (about 4 s): setup slows as connections accumulate (docs/RELIABILITY.md
// "Scale"), and the default suite runs on a shared 2-core machine. SWIRL_SCALE_CONNECTIONS runs
// it with more (10,000 checked: 97 s on a quiet machine, 5 minutes on a busy one).
const int kConnections = [] {
  int n = 1000;
  if (const char* env = std::getenv("SWIRL_SCALE_CONNECTIONS")) {
    if (!absl::SimpleAtoi(env, &n) || n <= 600) n = 1000;
  }
  return n;
}();
// Connections opened before the memory baseline is taken: the first ones pay for what is made
// once (gRPC's threads, the runtime's pools, pages of the server's tables).
constexpr int kWarmup = 100;
// SWIRL_SCALE_SETUP_THREADS=T: after the first kWarmup, the connections are opened from T
// threads at once on the one runtime (each its share, a first call on each), to measure the
// setup rate of one client process with concurrent setups; 1 (the default): one at a time.
const int kSetupThreads = [] {
  int n = 1;
  if (const char* env = std::getenv("SWIRL_SCALE_SETUP_THREADS")) {
    if (!absl::SimpleAtoi(env, &n) || n < 1 || n > 64) n = 1;
  }
  return n;
}();

// CPU time (user + system) process `pid` has used, in milliseconds, from /proc/<pid>/stat: what
// connection setup costs whatever else the machine runs (a wall-clock rate on a shared 2-core
// machine mostly measures the other builds).
double CpuMs(const std::string& pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command name, which is in parentheses and may hold spaces.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::vector<std::string> fields = absl::StrSplit(stat.substr(close + 2), ' ');
  // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
  int64_t utime = 0, stime = 0;
  if (fields.size() < 13 || !absl::SimpleAtoi(fields[11], &utime) ||
      !absl::SimpleAtoi(fields[12], &stime)) {
    return -1;
  }
  return 1000.0 * static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Open descriptors of process `pid` ("self" for this one), from /proc; -1 if unreadable.
int OpenDescriptors(const std::string& pid) {
  DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(dir)) n += e->d_name[0] != '.';
  closedir(dir);
  return pid == "self" ? n - 1 : n;  // (opendir's own)
}

// Descriptors per connection, at most, on each side: the soft device's one connection per QP
// pair (its end in each process; docs/SOFT_WIRE.md); channels share one gRPC connection and
// each peer device's wake eventfd is held once. Checked below, with room for crossed hellos
// (both QPs at RTR before either hello arrived: two connections for that pair; measured 21% of
// pairs here, more on a busier machine).
constexpr double kDescriptorsPerConnection = 1.5;

// More descriptors than a default soft limit of 1024. The soft limit goes up to the hard one
// (20,000 in this project's container, where root cannot raise it).
void RaiseFileLimit() {
  rlimit limit;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &limit), 0);
  limit.rlim_cur = limit.rlim_max;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &limit), 0);
  ASSERT_GE(limit.rlim_cur, static_cast<rlim_t>(kDescriptorsPerConnection * kConnections + 200))
      << "this test needs about " << kDescriptorsPerConnection
      << " file descriptors per connection";
}

TEST(ScaleTest, OneWorkerHoldsThousandsOfConnectionsThatAllAnswer) {
  ASSERT_NO_FATAL_FAILURE(RaiseFileLimit());
  auto server = SpawnServer(kServer, {absl::StrCat("--max_connections=", kConnections + 10),
                                      absl::StrCat("--max_per_client=", kConnections + 10),
                                      "--workers=1", "--keepalive_ms=0",
                                      "--bulk_pool_bytes=0"});
  ASSERT_TRUE(server.ok()) << server.status();
  ChildProcess& child = server->first;
  const int port = server->second;
  const std::string server_pid = std::to_string(child.pid());

  ClientRuntimeOptions runtime_options;
  runtime_options.max_channels = kConnections + 10;
  runtime_options.transport.bulk_pool_bytes = 0;
  auto runtime = ClientRuntime::Create(runtime_options);
  ASSERT_TRUE(runtime.ok()) << runtime.status();
  ChannelOptions options;
  options.runtime = *runtime;
  options.transport = runtime_options.transport;

  std::vector<std::shared_ptr<Channel>> channels;
  channels.reserve(kConnections);
  int64_t server_base = 0, client_base = 0;
  int server_fds_base = -1, client_fds_base = -1;
  absl::Time lap = absl::Now();
  absl::Duration in_connect, in_call;
  double client_cpu = CpuMs("self"), server_cpu = CpuMs(server_pid);
  const int sequential = kSetupThreads > 1 ? kWarmup : kConnections;
  for (int i = 0; i < sequential; ++i) {
    const absl::Time t0 = absl::Now();
    auto channel = Connect(port, "e2e", options);
    ASSERT_TRUE(channel.ok()) << "channel " << i << ": " << channel.status();
    const absl::Time t1 = absl::Now();
    const std::string hello = absl::StrCat("first ", i);
    ASSERT_EQ(Echo(**channel, hello), hello) << "channel " << i;
    in_connect += t1 - t0;
    in_call += absl::Now() - t1;
    channels.push_back(*std::move(channel));
    if ((i + 1) % 250 == 0) {
      const double client_cpu_now = CpuMs("self"), server_cpu_now = CpuMs(server_pid);
      std::printf("%d connections, %.0f/s since the last report (%.2f ms in Channel::Create, "
                  "%.2f ms in the first call, each; CPU per connection: client %.2f ms, server "
                  "%.2f ms)\n",
                  i + 1, 250 / absl::ToDoubleSeconds(absl::Now() - lap),
                  absl::ToDoubleMilliseconds(in_connect) / 250,
                  absl::ToDoubleMilliseconds(in_call) / 250, (client_cpu_now - client_cpu) / 250,
                  (server_cpu_now - server_cpu) / 250);
      client_cpu = client_cpu_now;
      server_cpu = server_cpu_now;
      std::fflush(stdout);
      lap = absl::Now();
      in_connect = in_call = absl::ZeroDuration();
    }
    if (i + 1 == kWarmup) {
      server_base = swirl::ResidentKib(child.pid());
      client_base = swirl::ResidentKib(0);
      server_fds_base = OpenDescriptors(server_pid);
      client_fds_base = OpenDescriptors("self");
    }
  }
  if (kSetupThreads > 1) {
    const int rest = kConnections - kWarmup;
    std::vector<std::vector<std::shared_ptr<Channel>>> opened(kSetupThreads);
    std::vector<std::string> errors(kSetupThreads);
    std::vector<std::thread> threads;
    const double client_cpu0 = CpuMs("self"), server_cpu0 = CpuMs(server_pid);
    const absl::Time start = absl::Now();
    for (int t = 0; t < kSetupThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = kWarmup + t; i < kConnections; i += kSetupThreads) {
          auto channel = Connect(port, "e2e", options);
          if (!channel.ok()) {
            errors[t] = absl::StrCat("channel ", i, ": ", channel.status().ToString());
            return;
          }
          const std::string hello = absl::StrCat("first ", i);
          const std::string answer = Echo(**channel, hello);
          if (answer != hello) {
            errors[t] = absl::StrCat("channel ", i, " answered \"", answer, "\"");
            return;
          }
          opened[t].push_back(*std::move(channel));
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
    for (const std::string& error : errors) ASSERT_TRUE(error.empty()) << error;
    std::printf("%d connections from %d threads at once after the first %d: %.0f/s (CPU per "
                "connection: client %.2f ms, server %.2f ms)\n",
                rest, kSetupThreads, kWarmup, rest / seconds,
                (CpuMs("self") - client_cpu0) / rest, (CpuMs(server_pid) - server_cpu0) / rest);
    std::fflush(stdout);
    for (auto& list : opened) {
      for (auto& channel : list) channels.push_back(std::move(channel));
    }
  }
  // What the second calls add: no connection is made, so growth here would be memory that
  // each message costs (receive buffers touched for the first time, say), not the connection's
  // own; measured 0.1 KiB per connection on each side, so the figure per idle connection below
  // is what the connections hold.
  const int64_t server_before_second = swirl::ResidentKib(child.pid());
  const int64_t client_before_second = swirl::ResidentKib(0);
  const absl::Time second_start = absl::Now();
  for (int i = 0; i < kConnections; ++i) {
    const std::string again = absl::StrCat("second ", i);
    ASSERT_EQ(Echo(*channels[i], again), again) << "channel " << i;
  }
  std::printf("second call on each: %.0f/s; memory it added per connection: server %.1f KiB, "
              "client %.1f KiB\n",
              kConnections / absl::ToDoubleSeconds(absl::Now() - second_start),
              static_cast<double>(swirl::ResidentKib(child.pid()) - server_before_second) /
                  kConnections,
              static_cast<double>(swirl::ResidentKib(0) - client_before_second) / kConnections);
  const double server_fds = static_cast<double>(OpenDescriptors(server_pid) - server_fds_base) /
                            (kConnections - kWarmup);
  const double client_fds = static_cast<double>(OpenDescriptors("self") - client_fds_base) /
                            (kConnections - kWarmup);
  std::printf("descriptors per connection: server %.2f, client %.2f\n", server_fds, client_fds);
  ASSERT_GE(server_fds_base, 0);
  ASSERT_GE(client_fds_base, 0);
  EXPECT_LE(server_fds, kDescriptorsPerConnection);
  EXPECT_LE(client_fds, kDescriptorsPerConnection);
  auto stats = Stats(port);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->server().connections_active(), static_cast<uint64_t>(kConnections));
  EXPECT_GT(stats->server().connections_active(), static_cast<uint64_t>(kOldLimit));

  const int64_t server_now = swirl::ResidentKib(child.pid());
  const int64_t client_now = swirl::ResidentKib(0);
  ASSERT_GT(server_base, 0);
  ASSERT_GT(client_base, 0);
  const double per_server = static_cast<double>(server_now - server_base) / (kConnections - kWarmup);
  const double per_client = static_cast<double>(client_now - client_base) / (kConnections - kWarmup);
  std::printf("memory per idle connection: server %.1f KiB, client %.1f KiB\n", per_server,
              per_client);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  // Sanitizer builds add shadow memory and redzones to every allocation (ASan measured 133 and
  // 147 KiB): what a connection costs is what an ordinary build measures, so only the
  // admission and the answers are checked here.
  std::printf("sanitizer build: memory per connection printed, not checked\n");
#else
  EXPECT_LT(per_server, 64.0) << "KiB of server memory per connection";
  // The target is 64 KiB on this side too; measured 63.6 KiB (docs/RELIABILITY.md "Scale"),
  // too close to the target to assert it on a shared machine, so the bound here guards what is
  // reached (the client took 1.5 MiB per channel before) with room for the noise.
  EXPECT_LT(per_client, 80.0) << "KiB of client memory per connection";
#endif
  const absl::Time close_start = absl::Now();
  const size_t closing = channels.size();
  channels.clear();
  std::printf("closing %zu channels: %.3f ms each\n", closing,
              absl::ToDoubleMilliseconds(absl::Now() - close_start) / closing);
}

}  // namespace
}  // namespace swirl::testing
