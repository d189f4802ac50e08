// Instruction path of the soft device, without cross-core effects: both QPs of a SEND/RECV
// ping-pong live in one thread, so every poll finds its message at once. Run under
// `valgrind --tool=callgrind` for stable instruction counts per round trip (see
// docs/BENCHMARKS.md); wall time here is the software cost only, not a latency.

#include <benchmark/benchmark.h>

// valgrind's client requests (a Debian package `./swirl` installs); without the header the
// instrumentation requests are no-ops and --count still runs, just uncounted.
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else
#define CALLGRIND_ZERO_STATS
#define CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_STOP_INSTRUMENTATION
#define CALLGRIND_DUMP_STATS_AT(name)
#endif

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "transport/soft/soft_device.h"
#include "transport/verbs/verbs.h"

namespace swirl {
namespace {

struct Side {
  std::shared_ptr<verbs::Context> ctx;
  std::shared_ptr<verbs::ProtectionDomain> pd;
  std::shared_ptr<verbs::CompletionQueue> cq;
  std::unique_ptr<verbs::QueuePair> qp;
  std::vector<char> buf = std::vector<char>(1 << 16);
  std::unique_ptr<verbs::MemoryRegion> mr;
};

// An RC QP completing into `cq`, with room for the benchmark's inline SENDs.
std::unique_ptr<verbs::QueuePair> MakeQp(const std::shared_ptr<verbs::ProtectionDomain>& pd,
                                         const std::shared_ptr<verbs::CompletionQueue>& cq) {
  verbs::QueuePairConfig config;
  config.send_cq = cq;
  config.recv_cq = cq;
  config.max_send_wr = 256;
  config.max_recv_wr = 256;
  config.max_inline_data = 256;
  return *verbs::QueuePair::Create(pd, config);
}

Side MakeSide(const char* name) {
  Side s;
  s.ctx = verbs::Context::Wrap(*soft::OpenSoftDevice(name));
  s.pd = *verbs::ProtectionDomain::Create(s.ctx);
  s.cq = *verbs::CompletionQueue::Create(s.ctx, 1024);
  s.qp = MakeQp(s.pd, s.cq);
  s.mr = *verbs::MemoryRegion::Register(s.pd, s.buf.data(), s.buf.size(), IBV_ACCESS_LOCAL_WRITE);
  return s;
}

void PostRecv(Side& s) {
  ibv_sge sge{reinterpret_cast<uint64_t>(s.buf.data()), 4096, s.mr->lkey()};
  ibv_recv_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad;
  ibv_post_recv(s.qp->get(), &wr, &bad);
}

void Send(Side& s, uint64_t i) {
  ibv_sge sge{reinterpret_cast<uint64_t>(s.buf.data() + 8192), 64, s.mr->lkey()};
  ibv_send_wr wr{};
  wr.wr_id = i;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_INLINE | ((i % 64 == 63) ? IBV_SEND_SIGNALED : 0);
  ibv_send_wr* bad;
  ibv_post_send(s.qp->get(), &wr, &bad);
}

uint64_t g_polls = 0;

void WaitRecv(Side& s) {
  ibv_wc wc[4];
  for (;;) {
    ++g_polls;
    int n = ibv_poll_cq(s.cq->get(), 4, wc);
    for (int k = 0; k < n; ++k) {
      if (wc[k].opcode == IBV_WC_RECV) return;
    }
  }
}

struct Pair;
void RoundTrip(Pair& p, uint64_t i);

struct Pair {
  Side a = MakeSide("soft0");
  Side b = MakeSide("soft0");
};

// Connects the two QPs and runs round trips until the link is up and the path is warm.
void Connect(Pair& p) {
  Side& a = p.a;
  Side& b = p.b;
  verbs::ConnectOptions co;
  auto aa = *a.qp->LocalAddress(1, co);
  auto ba = *b.qp->LocalAddress(2, co);
  (void)a.qp->Connect(ba, 1, co);
  (void)b.qp->Connect(aa, 2, co);
  for (int i = 0; i < 128; ++i) {
    PostRecv(a);
    PostRecv(b);
  }
  // One round trip first: the link between the QPs is set up asynchronously.
  Send(a, 0);
  WaitRecv(b);
  PostRecv(b);
  Send(b, 0);
  WaitRecv(a);
  PostRecv(a);
  for (uint64_t i = 1; i < 1000; ++i) RoundTrip(p, i);
}

void RoundTrip(Pair& p, uint64_t i) {
  Send(p.a, i);
  WaitRecv(p.b);
  PostRecv(p.b);
  Send(p.b, i);
  WaitRecv(p.a);
  PostRecv(p.a);
}

void BM_SoftSendRecvRoundTripOneThread(benchmark::State& state) {
  Pair p;
  Connect(p);
  Side& a = p.a;
  Side& b = p.b;
  g_polls = 0;
  uint64_t i = 1000;
  for (auto _ : state) {
    Send(a, i);
    WaitRecv(b);
    PostRecv(b);
    Send(b, i);
    WaitRecv(a);
    PostRecv(a);
    ++i;
  }
  state.SetItemsProcessed(static_cast<int64_t>(i - 1000));
  state.counters["polls_per_wait"] =
      static_cast<double>(g_polls) / (2.0 * static_cast<double>(i - 1000));
  g_polls = 0;
}
BENCHMARK(BM_SoftSendRecvRoundTripOneThread);

// The empty poll of a CQ that many connected, idle QPs complete into: an RPC worker's CQ with
// kSharedCqQps clients, none of which has sent anything yet.
constexpr int kSharedCqQps = 16;

int CountSharedCqEmptyPolls(uint64_t n) {
  Side hub = MakeSide("soft0");
  std::vector<std::unique_ptr<verbs::QueuePair>> qps;
  std::vector<Side> peers;
  verbs::ConnectOptions co;
  for (int i = 0; i < kSharedCqQps; ++i) {
    qps.push_back(MakeQp(hub.pd, hub.cq));
    peers.push_back(MakeSide("soft0"));
    Side& peer = peers.back();
    auto local = *qps.back()->LocalAddress(1, co);
    auto remote = *peer.qp->LocalAddress(2, co);
    (void)qps.back()->Connect(remote, 1, co);
    (void)peer.qp->Connect(local, 2, co);
    // One SEND from each peer, received on the hub: the link is up and the path warm.
    ibv_sge sge{reinterpret_cast<uint64_t>(hub.buf.data()), 4096, hub.mr->lkey()};
    ibv_recv_wr rwr{};
    rwr.sg_list = &sge;
    rwr.num_sge = 1;
    ibv_recv_wr* bad;
    for (int k = 0; k < 8; ++k) ibv_post_recv(qps.back()->get(), &rwr, &bad);
    Send(peer, 0);
    WaitRecv(hub);
  }
  ibv_wc wc[16];
  for (int i = 0; i < 1000; ++i) {
    if (ibv_poll_cq(hub.cq->get(), 16, wc) != 0) {
      std::fprintf(stderr, "an idle shared CQ produced a completion\n");
      return 1;
    }
  }
  int found = 0;
  CALLGRIND_ZERO_STATS;
  CALLGRIND_START_INSTRUMENTATION;
  for (uint64_t i = 0; i < n; ++i) found += ibv_poll_cq(hub.cq->get(), 16, wc);
  CALLGRIND_STOP_INSTRUMENTATION;
  CALLGRIND_DUMP_STATS_AT("empty polls of a shared CQ");
  if (found != 0) {
    std::fprintf(stderr, "an empty poll found %d completions\n", found);
    return 1;
  }
  std::printf("%lu empty polls of a CQ with %d idle QPs; instructions per poll = Ir / %lu "
              "(third dump)\n",
              static_cast<unsigned long>(n), kSharedCqQps, static_cast<unsigned long>(n));
  return 0;
}

// Under callgrind: exactly `n` warm round trips are instrumented, nothing else (no setup, no
// link wait), so the instruction count per round trip is Ir / n.
int CountInstructions(uint64_t n) {
  // Only this thread's work: the HCA thread would otherwise make progress for the CQs this
  // thread is not polling at the moment (the other phases' QPs), and callgrind counts every
  // thread.
  setenv("SWIRL_SOFT_PROGRESS", "off", /*overwrite=*/1);
  Pair p;
  Connect(p);
  g_polls = 0;
  CALLGRIND_ZERO_STATS;
  CALLGRIND_START_INSTRUMENTATION;
  for (uint64_t i = 0; i < n; ++i) RoundTrip(p, 1000 + i);
  CALLGRIND_STOP_INSTRUMENTATION;
  CALLGRIND_DUMP_STATS_AT("round trips");
  std::printf("%lu round trips, %.2f polls per wait; instructions per round trip = Ir / %lu\n",
              static_cast<unsigned long>(n), static_cast<double>(g_polls) / (2.0 * n),
              static_cast<unsigned long>(n));

  // The poll a waiting side spins on: A has sent (an unsignaled SEND awaiting its ack, as in a
  // ping-pong) and polls a CQ that stays empty because B does not answer yet. Its cost is how
  // late, on average, a waiting side notices a message that has landed.
  Send(p.a, 1000 + n);
  ibv_wc wc[16];
  int found = 0;
  CALLGRIND_ZERO_STATS;
  CALLGRIND_START_INSTRUMENTATION;
  for (uint64_t i = 0; i < n; ++i) found += ibv_poll_cq(p.a.cq->get(), 16, wc);
  CALLGRIND_STOP_INSTRUMENTATION;
  CALLGRIND_DUMP_STATS_AT("empty polls");
  if (found != 0) {
    std::fprintf(stderr, "an empty poll found %d completions\n", found);
    return 1;
  }
  std::printf("%lu empty polls; instructions per empty poll = Ir / %lu (second dump)\n",
              static_cast<unsigned long>(n), static_cast<unsigned long>(n));
  return CountSharedCqEmptyPolls(n);
}

}  // namespace
}  // namespace swirl

// `soft_path_bench --count N` or `--count=N` (under `valgrind --tool=callgrind
// --instr-atstart=no`) counts instructions; otherwise Google Benchmark's flags apply.
int main(int argc, char** argv) {
  const std::string first = argc > 1 ? argv[1] : "";
  std::string count_text;
  if (first == "--count" && argc == 3) count_text = argv[2];
  if (first.rfind("--count=", 0) == 0 && argc == 2) count_text = first.substr(8);
  if (first == "--count" || first.rfind("--count=", 0) == 0) {
    char* end = nullptr;
    const unsigned long long n = std::strtoull(count_text.c_str(), &end, 10);
    if (count_text.empty() || *end != 0 || n == 0 || n > (1ull << 32)) {
      std::fprintf(stderr, "usage: soft_path_bench --count N   (N round trips, 1 .. 2^32)\n");
      return 2;
    }
    return swirl::CountInstructions(n);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  return 0;
}
