// verbs_perf: a perftest-style latency and bandwidth tool over any swirl device (rdma-core or
// the soft device).
//
//   bazel-bin/bench/verbs_perf --test send_lat --size 64          # both sides on this host
//   bazel-bin/bench/verbs_perf --test write_bw --size 1048576 --json
//   bazel-bin/bench/verbs_perf --test write_lat -a                 # sizes 2 B .. 8 MiB
//   bazel-bin/bench/verbs_perf --raw                               # shared-memory floor
//   bazel-bin/bench/verbs_perf --server --port 18515               # one side ...
//   bazel-bin/bench/verbs_perf --connect host --port 18515 --test read_lat   # ... the other
//
// With neither --server nor --connect the tool runs both sides itself: it spawns
// /proc/self/exe as the server (pinned to --server_core) and runs the client (pinned to
// --client_core). The client decides the test and sends its parameters to the server over the
// TCP out-of-band channel, which also carries the verbs::PeerAddress, rkey and buffer address,
// and the per-size start/stop handshake.
//
// Each side's buffer is two regions of the largest message size: a send region (source of
// SENDs and WRITEs, target of the peer's READs) and a receive region (target of the peer's
// WRITEs and of RECVs and local READs).
//
// Latency tests are ping-pongs timed with the TSC: a sample is the time from one iteration's
// post to the next one's (a round trip, as perftest measures). Text output halves it, as
// perftest prints one-way latency, except for read_lat where perftest prints the full READ
// round trip; JSON always reports round trips (rtt_*).
//
// Progress: the soft device moves data only when a process calls into it, so a side that
// waits (for a byte to change, or for the test to end) keeps polling its CQ.

#include <infiniband/verbs.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "bench/perf_common.h"
#include "transport/device.h"
#include "transport/soft/soft_device.h"
#include "transport/verbs/verbs.h"

ABSL_FLAG(std::string, test, "send_lat", "send_lat|write_lat|read_lat|send_bw|write_bw");
ABSL_FLAG(uint64_t, size, 64, "message size in bytes");
ABSL_FLAG(uint64_t, iters, 0,
          "measured iterations per size; 0: automatic (more for small messages)");
ABSL_FLAG(int64_t, warmup, -1, "untimed iterations before each measurement; -1: iters/10");
ABSL_FLAG(bool, a, false, "same as --all");
ABSL_FLAG(bool, all, false, "sweep sizes 2 B .. 8 MiB in powers of two");
ABSL_FLAG(std::string, device, "",
          "device name (mlx5_0, soft0, ...); empty: swirl::OpenDevice's automatic choice");
ABSL_FLAG(int, client_core, 0, "CPU the client is pinned to (-1: no pinning)");
ABSL_FLAG(int, server_core, 1, "CPU the server is pinned to (-1: no pinning)");
ABSL_FLAG(bool, server, false, "run as the server side: wait for a client on --port");
ABSL_FLAG(std::string, connect, "", "run as the client side against a server on HOST");
ABSL_FLAG(int, port, 18515, "TCP port of the out-of-band exchange (--server / --connect)");
ABSL_FLAG(bool, json, false, "print one JSON object on one line instead of the table");
ABSL_FLAG(bool, raw, false,
          "measure the physical floor: two pinned processes ping-ponging one cache line "
          "through shared memory");
ABSL_FLAG(bool, inline, true,
          "post SENDs and WRITEs with IBV_SEND_INLINE when they fit the QP's max inline data");
ABSL_FLAG(uint32_t, inline_size, 220,
          "max inline data to ask the QP for (the device may grant less)");
ABSL_FLAG(uint32_t, tx_depth, 128, "bandwidth tests: work requests outstanding");
ABSL_FLAG(uint32_t, cq_mod, 100,
          "bandwidth tests: signal one work request in this many (capped at tx_depth)");
ABSL_FLAG(uint32_t, rx_depth, 512, "send_bw: receives kept posted at the server");
ABSL_FLAG(int, ib_port, 1, "device port");
ABSL_FLAG(int, gid_index, -1, "GID index (RoCE); -1: pick (RoCE v2 and IPv4 first)");
ABSL_FLAG(bool, mutex_deadlock_detection, true,
          "leave absl::Mutex deadlock detection at Abseil's default (on in Debian's Abseil, "
          "which is built without NDEBUG); false: SetMutexDeadlockDetectionMode(kIgnore) in "
          "both processes");
ABSL_FLAG(std::string, samples_out, "",
          "latency tests and --raw: also write every round-trip sample (microseconds, in "
          "iteration order, one per line) to this file; with -a, to FILE.<size>");
ABSL_FLAG(double, timeout, 60, "seconds any single wait may take before the run is aborted");
ABSL_FLAG(std::string, link_key, "",
          "soft device: 64 hex digits, the link key both QPs get (SetLinkKey), for measuring "
          "authenticated links and sealed TCP records (SWIRL_SOFT_TCP_CRYPT=off: unsealed); "
          "ignored by other devices");
// Internal: how the single-host mode starts its server child.
ABSL_FLAG(int, oob_fd, -1, "internal: inherited listening socket (spawned server)");
ABSL_FLAG(int, spawned_by, 0, "internal: the process that started this one (die with it)");
ABSL_FLAG(bool, raw_child, false, "internal: the --raw responder");
ABSL_FLAG(int, raw_fd, -1, "internal: the --raw shared memory");

namespace swirl::bench {
namespace {

enum class Test : uint32_t { kSendLat = 1, kWriteLat, kReadLat, kSendBw, kWriteBw };

constexpr struct {
  Test test;
  const char* name;
  const char* title;
} kTests[] = {
    {Test::kSendLat, "send_lat", "Send Latency Test"},
    {Test::kWriteLat, "write_lat", "RDMA Write Latency Test"},
    {Test::kReadLat, "read_lat", "RDMA Read Latency Test"},
    {Test::kSendBw, "send_bw", "Send BW Test"},
    {Test::kWriteBw, "write_bw", "RDMA Write BW Test"},
};

const char* TestName(Test t) {
  for (const auto& e : kTests) {
    if (e.test == t) return e.name;
  }
  return "?";
}
const char* TestTitle(Test t) {
  for (const auto& e : kTests) {
    if (e.test == t) return e.title;
  }
  return "?";
}
bool IsBw(Test t) { return t == Test::kSendBw || t == Test::kWriteBw; }

constexpr uint64_t kMaxSweepSize = 8ull << 20;
constexpr uint32_t kLatSqDepth = 128;
constexpr uint32_t kLatCqMod = 64;
constexpr uint32_t kLatRxDepth = 64;

// ---- Out-of-band messages (both ends run this binary) -----------------------------------------

constexpr uint64_t kMagic = 0x3146524550535756ull;  // "VWSPERF1"
constexpr uint32_t kVersion = 1;

struct WireConfig {
  uint64_t magic;
  uint32_t version;
  uint32_t test;
  uint64_t max_size;
  uint32_t tx_depth;
  uint32_t cq_mod;
  uint32_t rx_depth;
  uint32_t use_inline;
  uint32_t inline_size;
  uint32_t reserved;
};

struct WireInfo {
  verbs::PeerAddress addr;
  uint64_t buf_addr;
  uint64_t region;
  uint32_t rkey;
  uint32_t max_inline;
  int32_t core;
  char device[36];
};

enum MsgType : uint32_t { kStart = 1, kReady, kDone, kDoneAck, kBye, kByeAck };

struct WireMsg {
  uint32_t type;
  uint32_t reserved;
  uint64_t size;
  uint64_t iters;
  uint64_t warmup;
};

WireMsg Msg(MsgType type, uint64_t size = 0, uint64_t iters = 0, uint64_t warmup = 0) {
  WireMsg m{};
  m.type = type;
  m.size = size;
  m.iters = iters;
  m.warmup = warmup;
  return m;
}

void Expect(const WireMsg& m, MsgType type) {
  if (m.type != type) Die("out-of-band protocol: expected message %u, got %u", type, m.type);
}

// ---- One side's verbs resources -----------------------------------------------------------------

struct Endpoint {
  std::shared_ptr<verbs::Context> ctx;
  std::shared_ptr<verbs::ProtectionDomain> pd;
  std::shared_ptr<verbs::CompletionQueue> cq;
  std::unique_ptr<verbs::QueuePair> qp;
  std::unique_ptr<verbs::MemoryRegion> mr;
  char* buf = nullptr;
  uint64_t region = 0;  // bytes per region; buf holds two
  ibv_cq* raw_cq = nullptr;
  ibv_qp* raw_qp = nullptr;
  uint32_t lkey = 0;
  uint32_t max_inline = 0;
  bool use_inline = true;
  uint32_t sq_depth = 0;
  uint32_t cq_mod = 1;
  uint32_t rx_depth = 0;
  uint32_t psn = 0;
  // The peer's buffer.
  uint64_t remote_addr = 0;
  uint64_t remote_region = 0;
  uint32_t rkey = 0;
  // Work request accounting. send_done: every WR before it has completed.
  uint64_t send_seq = 0;
  uint64_t send_done = 0;
  uint64_t recv_posted = 0;
  uint64_t recv_done = 0;

  char* send_region() const { return buf; }
  char* recv_region() const { return buf + region; }

  ~Endpoint() {
    qp.reset();
    mr.reset();
    cq.reset();
    pd.reset();
    ctx.reset();
    if (buf != nullptr) munmap(buf, 2 * region);
  }
};

uint64_t RoundUp(uint64_t v, uint64_t to) { return (v + to - 1) / to * to; }

verbs::ConnectOptions Options() {
  verbs::ConnectOptions o;
  o.port_num = static_cast<uint8_t>(absl::GetFlag(FLAGS_ib_port));
  o.gid_index = absl::GetFlag(FLAGS_gid_index);
  return o;
}

void Setup(Endpoint& e, const std::string& device, const WireConfig& cfg) {
  const Test test = static_cast<Test>(cfg.test);
  auto ctx = swirl::OpenDevice(device);
  if (!ctx.ok()) Die("open device '%s': %s", device.c_str(), ctx.status().ToString().c_str());
  e.ctx = *ctx;
  auto pd = verbs::ProtectionDomain::Create(e.ctx);
  if (!pd.ok()) Die("%s", pd.status().ToString().c_str());
  e.pd = *pd;

  e.region = RoundUp(std::max<uint64_t>(cfg.max_size, 64), 4096);
  void* mem = mmap(nullptr, 2 * e.region, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (mem == MAP_FAILED) Die("mmap %lu bytes: %s", 2 * e.region, std::strerror(errno));
  e.buf = static_cast<char*>(mem);
  std::memset(e.buf, 0, 2 * e.region);  // fault it in before anything is timed
  for (uint64_t i = 0; i < e.region; i += 64) e.buf[i] = static_cast<char>(i / 64);
  auto mr = verbs::MemoryRegion::Register(
      e.pd, e.buf, 2 * e.region,
      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
  if (!mr.ok()) Die("%s", mr.status().ToString().c_str());
  e.mr = std::move(*mr);
  e.lkey = e.mr->lkey();

  if (IsBw(test)) {
    e.sq_depth = std::max<uint32_t>(cfg.tx_depth, 1);
    e.cq_mod = std::clamp<uint32_t>(cfg.cq_mod, 1, e.sq_depth);
  } else {
    e.sq_depth = kLatSqDepth;
    e.cq_mod = kLatCqMod;
  }
  e.rx_depth = test == Test::kSendBw ? std::max<uint32_t>(cfg.rx_depth, 2)
               : test == Test::kSendLat ? kLatRxDepth
                                        : 0;
  auto cq = verbs::CompletionQueue::Create(e.ctx, static_cast<int>(e.sq_depth + e.rx_depth + 32));
  if (!cq.ok()) Die("%s", cq.status().ToString().c_str());
  e.cq = *cq;
  e.raw_cq = e.cq->get();

  e.use_inline = cfg.use_inline != 0;
  uint32_t want_inline = e.use_inline ? cfg.inline_size : 0;
  for (;;) {
    verbs::QueuePairConfig qc;
    qc.send_cq = e.cq;
    qc.recv_cq = e.cq;
    qc.max_send_wr = e.sq_depth;
    qc.max_recv_wr = std::max<uint32_t>(e.rx_depth, 1);
    qc.max_inline_data = want_inline;
    auto qp = verbs::QueuePair::Create(e.pd, qc);
    if (qp.ok()) {
      e.qp = std::move(*qp);
      break;
    }
    if (want_inline == 0) Die("create QP: %s", qp.status().ToString().c_str());
    want_inline /= 2;  // the device may cap inline data lower than asked
    if (want_inline < 16) want_inline = 0;
  }
  e.raw_qp = e.qp->get();
  e.max_inline = e.use_inline ? e.qp->cap().max_inline_data : 0;
  if (auto s = e.qp->ToInit(Options()); !s.ok()) Die("%s", s.ToString().c_str());
  std::random_device rd;
  e.psn = rd() & 0xffffff;
}

WireInfo LocalInfo(Endpoint& e, int core) {
  auto addr = e.qp->LocalAddress(e.psn, Options());
  if (!addr.ok()) Die("%s", addr.status().ToString().c_str());
  WireInfo info{};
  info.addr = *addr;
  info.buf_addr = reinterpret_cast<uint64_t>(e.buf);
  info.region = e.region;
  info.rkey = e.mr->rkey();
  info.max_inline = e.max_inline;
  info.core = core;
  std::snprintf(info.device, sizeof(info.device), "%s", e.ctx->name().c_str());
  return info;
}

void PostRecvs(Endpoint& e, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    ibv_sge sge{reinterpret_cast<uint64_t>(e.recv_region()), static_cast<uint32_t>(e.region),
                e.lkey};
    ibv_recv_wr wr{};
    wr.wr_id = e.recv_posted;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    ibv_recv_wr* bad = nullptr;
    if (int rc = ibv_post_recv(e.raw_qp, &wr, &bad); rc != 0) {
      Die("ibv_post_recv: %s", std::strerror(rc));
    }
    ++e.recv_posted;
  }
}

void ConnectTo(Endpoint& e, const WireInfo& peer) {
  e.remote_addr = peer.buf_addr;
  e.remote_region = peer.region;
  e.rkey = peer.rkey;
  if (const std::string hex = absl::GetFlag(FLAGS_link_key); !hex.empty()) {
    const std::string key = absl::HexStringToBytes(hex);
    if (key.size() * 2 != hex.size()) Die("--link_key: not hex digits");
    const absl::Status s = swirl::soft::SetLinkKey(
        e.qp->get(), absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(key.data()),
                                               key.size()));
    if (!s.ok() && !absl::IsUnimplemented(s)) Die("--link_key: %s", s.ToString().c_str());
  }
  if (auto s = e.qp->Connect(peer.addr, e.psn, Options()); !s.ok()) {
    Die("connect QP: %s", s.ToString().c_str());
  }
  PostRecvs(e, e.rx_depth);
}

// ---- Data path ------------------------------------------------------------------------------

inline void PollOnce(Endpoint& e) {
  ibv_wc wc[16];
  const int n = ibv_poll_cq(e.raw_cq, 16, wc);
  if (n < 0) Die("ibv_poll_cq failed (%s)", std::strerror(errno));
  for (int i = 0; i < n; ++i) {
    if (wc[i].status != IBV_WC_SUCCESS) {
      Die("work completion error: %s (opcode %d, wr_id %lu)", ibv_wc_status_str(wc[i].status),
          wc[i].opcode, static_cast<unsigned long>(wc[i].wr_id));
    }
    if (wc[i].opcode & IBV_WC_RECV) {
      ++e.recv_done;
    } else {
      e.send_done = wc[i].wr_id + 1;  // signaled: everything before it has completed too
    }
  }
}

// Posts one SEND / RDMA WRITE (from the send region to the peer's receive region) or RDMA READ
// (from the peer's send region into the receive region). Returns the WR's sequence number.
inline uint64_t PostOne(Endpoint& e, ibv_wr_opcode op, uint32_t len, bool force_signal) {
  if (e.send_seq - e.send_done >= e.sq_depth) {
    SpinGuard guard("send queue space");
    while (e.send_seq - e.send_done >= e.sq_depth) {
      PollOnce(e);
      guard.Check();
    }
  }
  const uint64_t id = e.send_seq++;
  const bool read = op == IBV_WR_RDMA_READ;
  const bool signaled = force_signal || read || (id + 1) % e.cq_mod == 0;
  ibv_sge sge{reinterpret_cast<uint64_t>(read ? e.recv_region() : e.send_region()), len, e.lkey};
  ibv_send_wr wr{};
  wr.wr_id = id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = op;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  if (!read && len <= e.max_inline) wr.send_flags |= IBV_SEND_INLINE;
  if (op != IBV_WR_SEND) {
    wr.wr.rdma.remote_addr = e.remote_addr + (read ? 0 : e.remote_region);
    wr.wr.rdma.rkey = e.rkey;
  }
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(e.raw_qp, &wr, &bad); rc != 0) {
    Die("ibv_post_send: %s", std::strerror(rc));
  }
  return id;
}

void WaitRecvs(Endpoint& e, uint64_t target) {
  if (e.recv_done >= target) return;
  SpinGuard guard("a receive completion");
  while (e.recv_done < target) {
    PollOnce(e);
    guard.Check();
  }
}

void WaitSends(Endpoint& e, uint64_t target) {
  if (e.send_done >= target) return;
  SpinGuard guard("a send completion");
  while (e.send_done < target) {
    PollOnce(e);
    guard.Check();
  }
}

void DrainSends(Endpoint& e) { WaitSends(e, e.send_seq); }

// Spins on the last byte of the receive region until it reads `v`, making progress meanwhile.
inline void WaitByte(Endpoint& e, const char* p, char v) {
  if (__atomic_load_n(p, __ATOMIC_ACQUIRE) == v) return;
  SpinGuard guard("the peer's RDMA WRITE");
  while (__atomic_load_n(p, __ATOMIC_ACQUIRE) != v) {
    PollOnce(e);
    guard.Check();
  }
}

inline char IterByte(uint64_t i) { return static_cast<char>(i % 255 + 1); }

// Keeps the device moving until the client's next out-of-band message arrives.
WireMsg ProgressUntilMessage(Endpoint& e, Oob& oob) {
  const uint64_t interval = static_cast<uint64_t>(200 * TickClock::RoughTicksPerUs());
  uint64_t next = Ticks() + interval;
  WireMsg m;
  for (;;) {
    PollOnce(e);
    const uint64_t now = Ticks();
    if (now >= next) {
      if (oob.TryRecv(&m, sizeof(m))) return m;
      next = now + interval;
    }
  }
}

// ---- Client roles ----------------------------------------------------------------------------

struct Result {
  Test test;
  uint64_t size = 0, iters = 0, warmup = 0;
  LatencyStats lat;
  double seconds = 0;
  double bytes_per_s = 0, ops_per_s = 0, peak_bytes_per_s = 0;
};

// Latency: t[i] is the post time of iteration i; sample i = t[i+1] - t[i].
std::vector<uint64_t> Samples(const std::vector<uint64_t>& t, uint64_t warmup, uint64_t iters) {
  std::vector<uint64_t> rtt(iters);
  for (uint64_t i = 0; i < iters; ++i) rtt[i] = t[warmup + i + 1] - t[warmup + i];
  return rtt;
}

// --samples_out: the samples in iteration order, before the statistics sort them.
void DumpSamples(const std::vector<uint64_t>& rtt, uint64_t size, bool sweep) {
  std::string path = absl::GetFlag(FLAGS_samples_out);
  if (path.empty()) return;
  if (sweep) absl::StrAppend(&path, ".", size);
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) Die("cannot write %s: %s", path.c_str(), std::strerror(errno));
  const double tpu = TickClock::TicksPerUs();
  for (uint64_t t : rtt) std::fprintf(f, "%.4f\n", static_cast<double>(t) / tpu);
  std::fclose(f);
}

std::vector<uint64_t> ClientSendLat(Endpoint& e, uint32_t size, uint64_t total) {
  std::vector<uint64_t> t(total + 1);
  const uint64_t base = e.recv_done;
  uint64_t repost = 0;
  for (uint64_t i = 0; i < total; ++i) {
    t[i] = Ticks();
    PostOne(e, IBV_WR_SEND, size, i + 1 == total);
    if (repost != 0) {  // while the message is in flight; many receives stay posted
      PostRecvs(e, repost);
      repost = 0;
    }
    WaitRecvs(e, base + i + 1);
    repost = 1;
  }
  t[total] = Ticks();
  PostRecvs(e, repost);
  DrainSends(e);
  return t;
}

std::vector<uint64_t> ClientWriteLat(Endpoint& e, uint32_t size, uint64_t total) {
  std::vector<uint64_t> t(total + 1);
  char* src = e.send_region() + size - 1;
  const char* mine = e.recv_region() + size - 1;
  for (uint64_t i = 0; i < total; ++i) {
    const char v = IterByte(i);
    t[i] = Ticks();
    *src = v;
    PostOne(e, IBV_WR_RDMA_WRITE, size, i + 1 == total);
    WaitByte(e, mine, v);
  }
  t[total] = Ticks();
  DrainSends(e);
  return t;
}

std::vector<uint64_t> ClientReadLat(Endpoint& e, uint32_t size, uint64_t total) {
  std::vector<uint64_t> t(total + 1);
  for (uint64_t i = 0; i < total; ++i) {
    t[i] = Ticks();
    const uint64_t id = PostOne(e, IBV_WR_RDMA_READ, size, true);
    WaitSends(e, id + 1);
  }
  t[total] = Ticks();
  return t;
}

// tx_depth outstanding, one signaled WR in cq_mod (and the last). Completion times are those of
// the signaled completion that covered each WR.
void BwPhase(Endpoint& e, ibv_wr_opcode op, uint32_t size, uint64_t n, uint64_t* tposted,
             uint64_t* tcompleted) {
  const uint64_t base = e.send_seq;
  uint64_t posted = 0, done = 0;
  SpinGuard guard("bandwidth completions");
  while (done < n) {
    while (posted < n && posted - done < e.sq_depth) {
      if (tposted != nullptr) tposted[posted] = Ticks();
      PostOne(e, op, size, posted + 1 == n);
      ++posted;
    }
    PollOnce(e);
    const uint64_t now_done = e.send_done - base;
    if (now_done != done) {
      if (tcompleted != nullptr) {
        const uint64_t now = Ticks();
        for (uint64_t j = done; j < now_done; ++j) tcompleted[j] = now;
      }
      done = now_done;
      guard = SpinGuard("bandwidth completions");
    }
    guard.Check();
  }
}

Result ClientBw(Endpoint& e, Test test, uint32_t size, uint64_t iters, uint64_t warmup) {
  const ibv_wr_opcode op = test == Test::kSendBw ? IBV_WR_SEND : IBV_WR_RDMA_WRITE;
  if (warmup > 0) BwPhase(e, op, size, warmup, nullptr, nullptr);
  std::vector<uint64_t> tposted(iters), tcompleted(iters);
  BwPhase(e, op, size, iters, tposted.data(), tcompleted.data());
  const double tpu = TickClock::TicksPerUs();
  Result r;
  r.test = test;
  r.size = size;
  r.iters = iters;
  r.warmup = warmup;
  const double span_us = static_cast<double>(tcompleted[iters - 1] - tposted[0]) / tpu;
  r.seconds = span_us / 1e6;
  r.bytes_per_s = static_cast<double>(iters) * size / r.seconds;
  r.ops_per_s = static_cast<double>(iters) / r.seconds;
  // Peak: the best window of W consecutive WRs, from the completion of the WR before the window
  // (the post of WR 0 for the first window) to the completion of its last. Measuring from the
  // window's own first post would count the time that WR sat behind tx_depth others.
  // W spans several signaled completions, so their cq_mod granularity barely matters.
  const uint64_t w = std::min<uint64_t>(
      iters, std::max<uint64_t>({4 * static_cast<uint64_t>(e.cq_mod), 64, iters / 16}));
  double best_us = span_us;
  for (uint64_t i = 0; i + w <= iters; ++i) {
    const uint64_t start = i == 0 ? tposted[0] : tcompleted[i - 1];
    if (i > 0 && tcompleted[i - 1] == tcompleted[i]) continue;  // not a completion boundary
    const double us = static_cast<double>(tcompleted[i + w - 1] - start) / tpu;
    if (us > 0) best_us = std::min(best_us, us);
  }
  r.peak_bytes_per_s = std::max(static_cast<double>(w) * size / (best_us / 1e6), r.bytes_per_s);
  return r;
}

Result ClientRun(Endpoint& e, Test test, uint32_t size, uint64_t iters, uint64_t warmup) {
  if (IsBw(test)) return ClientBw(e, test, size, iters, warmup);
  std::vector<uint64_t> t;
  const uint64_t total = warmup + iters;
  switch (test) {
    case Test::kSendLat: t = ClientSendLat(e, size, total); break;
    case Test::kWriteLat: t = ClientWriteLat(e, size, total); break;
    default: t = ClientReadLat(e, size, total); break;
  }
  std::vector<uint64_t> rtt = Samples(t, warmup, iters);
  DumpSamples(rtt, size, absl::GetFlag(FLAGS_a) || absl::GetFlag(FLAGS_all));
  Result r;
  r.test = test;
  r.size = size;
  r.iters = iters;
  r.warmup = warmup;
  r.lat = ComputeLatency(rtt, TickClock::TicksPerUs());
  r.seconds = static_cast<double>(t[total] - t[warmup]) / TickClock::TicksPerUs() / 1e6;
  return r;
}

// Zeroes the byte write_lat polls, before the peer can write it.
void Prepare(Endpoint& e, Test test, uint64_t size) {
  if (test == Test::kWriteLat) {
    __atomic_store_n(e.recv_region() + size - 1, static_cast<char>(0), __ATOMIC_RELEASE);
  }
}

// ---- Server roles ----------------------------------------------------------------------------

void ServerRun(Endpoint& e, Test test, uint32_t size, uint64_t total) {
  switch (test) {
    case Test::kSendLat: {
      const uint64_t base = e.recv_done;
      for (uint64_t i = 0; i < total; ++i) {
        WaitRecvs(e, base + i + 1);
        PostOne(e, IBV_WR_SEND, size, i + 1 == total);
        PostRecvs(e, 1);
      }
      DrainSends(e);
      break;
    }
    case Test::kWriteLat: {
      char* src = e.send_region() + size - 1;
      const char* mine = e.recv_region() + size - 1;
      for (uint64_t i = 0; i < total; ++i) {
        const char v = IterByte(i);
        WaitByte(e, mine, v);
        *src = v;
        PostOne(e, IBV_WR_RDMA_WRITE, size, i + 1 == total);
      }
      DrainSends(e);
      break;
    }
    case Test::kSendBw: {
      const uint64_t target = e.recv_done + total;
      SpinGuard guard("SENDs from the client");
      uint64_t last = e.recv_done;
      while (e.recv_done < target) {
        PollOnce(e);
        const uint64_t outstanding = e.recv_posted - e.recv_done;
        if (outstanding <= e.rx_depth / 2) PostRecvs(e, e.rx_depth - outstanding);
        if (e.recv_done != last) {
          last = e.recv_done;
          guard = SpinGuard("SENDs from the client");
        }
        guard.Check();
      }
      PostRecvs(e, e.rx_depth - (e.recv_posted - e.recv_done));
      break;
    }
    default:
      break;  // write_bw, read_lat: the server is passive (but keeps polling, below)
  }
}

// ---- Output ------------------------------------------------------------------------------------

struct RunInfo {
  Test test;
  std::string device;
  std::string server_device;
  int client_core = -1, server_core = -1;
  uint32_t max_inline = 0;
  bool use_inline = true;
  uint32_t tx_depth = 0, cq_mod = 0;
};

std::string JsonEscape(absl::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      absl::StrAppendFormat(&out, "\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out;
}

void AppendLatencyJson(std::string& out, const LatencyStats& s) {
  absl::StrAppendFormat(&out,
                        ",\"rtt_min_us\":%.4f,\"rtt_p50_us\":%.4f,\"rtt_avg_us\":%.4f,"
                        "\"rtt_p99_us\":%.4f,\"rtt_p999_us\":%.4f,\"rtt_max_us\":%.4f,"
                        "\"rtt_stdev_us\":%.4f",
                        s.min_us, s.p50_us, s.avg_us, s.p99_us, s.p999_us, s.max_us, s.stdev_us);
}

std::string ResultJson(const RunInfo& info, const Result& r) {
  std::string out = absl::StrFormat(
      "{\"test\":\"%s\",\"device\":\"%s\",\"size\":%d,\"iters\":%d,\"warmup\":%d", TestName(r.test),
      JsonEscape(info.device), r.size, r.iters, r.warmup);
  const bool inlined = info.use_inline && r.test != Test::kReadLat && r.size <= info.max_inline;
  absl::StrAppendFormat(&out, ",\"inline\":%s", inlined ? "true" : "false");
  if (IsBw(r.test)) {
    absl::StrAppendFormat(&out,
                          // %g: a slow run of 2-byte messages is still a nonzero rate.
                          ",\"gbytes_per_s\":%.6g,\"ops_per_s\":%.0f,\"peak_gbytes_per_s\":%.6g,"
                          "\"bw_avg_mib_per_s\":%.6g,\"bw_peak_mib_per_s\":%.6g,\"seconds\":%.6g,"
                          "\"tx_depth\":%d,\"cq_mod\":%d",
                          r.bytes_per_s / 1e9, r.ops_per_s, r.peak_bytes_per_s / 1e9,
                          r.bytes_per_s / 1048576.0, r.peak_bytes_per_s / 1048576.0, r.seconds,
                          info.tx_depth, info.cq_mod);
  } else {
    AppendLatencyJson(out, r.lat);
    absl::StrAppendFormat(&out, ",\"seconds\":%.4f", r.seconds);
  }
  absl::StrAppendFormat(&out, ",\"client_core\":%d,\"server_core\":%d}", info.client_core,
                        info.server_core);
  return out;
}

constexpr char kRule[] =
    "---------------------------------------------------------------------------------------\n";

void PrintHeader(const RunInfo& info, bool all, uint64_t size) {
  std::printf("%s", kRule);
  std::printf("                    %s\n", TestTitle(info.test));
  std::printf(" Device          : %s (server: %s)\n", info.device.c_str(),
              info.server_device.c_str());
  std::printf(" Connection type : RC\n");
  if (IsBw(info.test)) {
    std::printf(" TX depth        : %u\n CQ moderation   : %u\n", info.tx_depth, info.cq_mod);
  } else {
    std::printf(" TX depth        : 1\n");
  }
  if (info.test == Test::kReadLat) {
    std::printf(" Inline data     : not used by RDMA READ\n");
  } else if (info.use_inline && info.max_inline > 0) {
    std::printf(" Inline data     : up to %u bytes\n", info.max_inline);
  } else {
    std::printf(" Inline data     : off\n");
  }
  std::printf(" Cores           : client %d, server %d\n", info.client_core, info.server_core);
  if (!all) std::printf(" Message size    : %lu\n", static_cast<unsigned long>(size));
  std::printf("%s", kRule);
  if (IsBw(info.test)) {
    std::printf(" #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   "
                "MsgRate[Mpps]\n");
  } else {
    std::printf(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    "
                "t_avg[usec]    t_stdev[usec]   99%% percentile[usec]   99.9%% percentile[usec]\n");
  }
  std::fflush(stdout);
}

void PrintLatencyRow(uint64_t size, uint64_t iters, const LatencyStats& s, double factor) {
  std::printf(" %-7lu %-10lu %-7.2f        %-7.2f      %-7.2f          %-7.2f        %-7.2f"
              "         %-7.2f                %-7.2f\n",
              static_cast<unsigned long>(size), static_cast<unsigned long>(iters),
              s.min_us * factor, s.max_us * factor, s.p50_us * factor, s.avg_us * factor,
              s.stdev_us * factor, s.p99_us * factor, s.p999_us * factor);
  std::fflush(stdout);
}

void PrintRow(const Result& r) {
  if (IsBw(r.test)) {
    // perftest's MB is 2^20 bytes.
    std::printf(" %-7lu    %-10lu       %-10.2f         %-10.2f           %-9.6f\n",
                static_cast<unsigned long>(r.size), static_cast<unsigned long>(r.iters),
                r.peak_bytes_per_s / 1048576.0, r.bytes_per_s / 1048576.0, r.ops_per_s / 1e6);
    std::fflush(stdout);
  } else {
    PrintLatencyRow(r.size, r.iters, r.lat, r.test == Test::kReadLat ? 1.0 : 0.5);
  }
}

void PrintFooter(Test test) {
  std::printf("%s", kRule);
  if (IsBw(test)) {
    std::printf(" MB = 2^20 bytes (as perftest); --json reports gbytes_per_s with GB = 1e9.\n");
  } else if (test == Test::kReadLat) {
    std::printf(" t_* are full READ round trips (perftest does not halve READ latency);\n"
                " --json reports rtt_* in microseconds.\n");
  } else {
    std::printf(" t_* are one-way latency = RTT/2, as perftest prints it; --json reports the\n"
                " round trip (rtt_*).\n");
  }
}

// ---- Sizes and iteration counts -----------------------------------------------------------------

uint64_t AutoIters(Test test, uint64_t size) {
  if (IsBw(test)) return std::clamp<uint64_t>((2ull << 30) / size, 200, 100000);
  return std::clamp<uint64_t>((256ull << 20) / size, 100, 100000);
}

uint64_t WarmupFor(uint64_t iters) {
  const int64_t flag = absl::GetFlag(FLAGS_warmup);
  if (flag >= 0) return static_cast<uint64_t>(flag);
  return std::max<uint64_t>(iters / 10, std::min<uint64_t>(iters, 16));
}

std::vector<uint64_t> Sizes() {
  std::vector<uint64_t> sizes;
  if (absl::GetFlag(FLAGS_a) || absl::GetFlag(FLAGS_all)) {
    for (uint64_t s = 2; s <= kMaxSweepSize; s *= 2) sizes.push_back(s);
  } else {
    sizes.push_back(absl::GetFlag(FLAGS_size));
  }
  return sizes;
}

Test ParseTest(const std::string& name) {
  for (const auto& e : kTests) {
    if (name == e.name) return e.test;
  }
  Die("unknown --test '%s' (send_lat, write_lat, read_lat, send_bw, write_bw)", name.c_str());
}

// Numbers from an unpinned run would be reported as pinned: a failure to pin ends the run
// (core -1 runs unpinned on purpose).
void PinOrDie(int core, const char* who) {
  if (core < 0) return;
  std::string error;
  if (!PinToCore(core, &error)) {
    Die("cannot pin the %s to core %d: %s (give -1 to run it unpinned)", who, core,
        error.c_str());
  }
}

void DieWithParent() {
  const int parent = absl::GetFlag(FLAGS_spawned_by);
  if (parent <= 0) return;
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  // The parent may have ended before prctl: then we were reparented already.
  if (getppid() != parent) std::_Exit(1);
}

// ---- The two sides -----------------------------------------------------------------------------

int RunServer() {
  const int core = absl::GetFlag(FLAGS_server_core);
  PinOrDie(core, "server");  // before the device starts its thread, which inherits it
  int listen_fd = absl::GetFlag(FLAGS_oob_fd);
  if (listen_fd < 0) {
    int port;
    listen_fd = ListenTcp("0.0.0.0", absl::GetFlag(FLAGS_port), &port);
    std::fprintf(stderr, "verbs_perf: server waiting on port %d\n", port);
  }
  Oob oob(AcceptOne(listen_fd, absl::GetFlag(FLAGS_oob_fd) >= 0 ? 30000 : 24 * 3600 * 1000));
  close(listen_fd);

  const auto cfg = oob.RecvMsg<WireConfig>();
  if (cfg.magic != kMagic || cfg.version != kVersion) Die("client speaks another protocol");
  const Test test = static_cast<Test>(cfg.test);
  Endpoint e;
  Setup(e, absl::GetFlag(FLAGS_device), cfg);
  oob.SendMsg(LocalInfo(e, core));
  ConnectTo(e, oob.RecvMsg<WireInfo>());

  for (;;) {
    const auto m = oob.RecvMsg<WireMsg>();
    if (m.type == kBye) break;
    Expect(m, kStart);
    if (m.size == 0 || m.size > e.region) Die("bad size %lu", static_cast<unsigned long>(m.size));
    Prepare(e, test, m.size);
    oob.SendMsg(Msg(kReady));
    ServerRun(e, test, static_cast<uint32_t>(m.size), m.warmup + m.iters);
    Expect(ProgressUntilMessage(e, oob), kDone);
    oob.SendMsg(Msg(kDoneAck));
  }
  oob.SendMsg(Msg(kByeAck));
  return 0;
}

int RunClient(int fd, const std::string& device, int server_core_hint) {
  const int core = absl::GetFlag(FLAGS_client_core);
  PinOrDie(core, "client");
  Oob oob(fd);
  const Test test = ParseTest(absl::GetFlag(FLAGS_test));
  const std::vector<uint64_t> sizes = Sizes();
  for (uint64_t s : sizes) {
    if (s == 0 || s > (1ull << 30)) Die("--size must be 1 .. 2^30");
  }
  WireConfig cfg{};
  cfg.magic = kMagic;
  cfg.version = kVersion;
  cfg.test = static_cast<uint32_t>(test);
  cfg.max_size = *std::max_element(sizes.begin(), sizes.end());
  cfg.tx_depth = absl::GetFlag(FLAGS_tx_depth);
  cfg.cq_mod = absl::GetFlag(FLAGS_cq_mod);
  cfg.rx_depth = absl::GetFlag(FLAGS_rx_depth);
  cfg.use_inline = absl::GetFlag(FLAGS_inline) ? 1 : 0;
  cfg.inline_size = absl::GetFlag(FLAGS_inline_size);
  oob.SendMsg(cfg);

  Endpoint e;
  Setup(e, device, cfg);
  const auto peer = oob.RecvMsg<WireInfo>();
  oob.SendMsg(LocalInfo(e, core));
  ConnectTo(e, peer);

  RunInfo info;
  info.test = test;
  info.device = e.ctx->name();
  info.server_device.assign(peer.device, strnlen(peer.device, sizeof(peer.device)));
  info.client_core = core;
  info.server_core = peer.core >= 0 ? peer.core : server_core_hint;
  info.max_inline = e.max_inline;
  info.use_inline = e.use_inline;
  info.tx_depth = e.sq_depth;
  info.cq_mod = e.cq_mod;

  const bool json = absl::GetFlag(FLAGS_json);
  const bool all = sizes.size() > 1;
  if (!json) PrintHeader(info, all, sizes[0]);
  std::vector<std::string> rows;
  for (uint64_t size : sizes) {
    const uint64_t iters =
        absl::GetFlag(FLAGS_iters) != 0 ? absl::GetFlag(FLAGS_iters) : AutoIters(test, size);
    const uint64_t warmup = WarmupFor(iters);
    Prepare(e, test, size);
    oob.SendMsg(Msg(kStart, size, iters, warmup));
    Expect(oob.RecvMsg<WireMsg>(), kReady);
    Result r = ClientRun(e, test, static_cast<uint32_t>(size), iters, warmup);
    oob.SendMsg(Msg(kDone));
    Expect(oob.RecvMsg<WireMsg>(), kDoneAck);
    if (json) {
      rows.push_back(ResultJson(info, r));
    } else {
      PrintRow(r);
    }
  }
  oob.SendMsg(Msg(kBye));
  Expect(oob.RecvMsg<WireMsg>(), kByeAck);

  if (json) {
    if (!all) {
      std::printf("%s\n", rows[0].c_str());
    } else {
      std::string out = absl::StrFormat("{\"test\":\"%s\",\"device\":\"%s\",\"results\":[",
                                        TestName(test), JsonEscape(info.device));
      for (size_t i = 0; i < rows.size(); ++i) absl::StrAppend(&out, i ? "," : "", rows[i]);
      absl::StrAppend(&out, "]}");
      std::printf("%s\n", out.c_str());
    }
  } else {
    PrintFooter(test);
  }
  std::fflush(stdout);
  return 0;
}

std::string ResolveDevice() {
  std::string device = absl::GetFlag(FLAGS_device);
  if (!device.empty() && device != "auto") return device;
  auto selected = swirl::SelectDeviceName();
  if (!selected.ok()) Die("choose a device: %s", selected.status().ToString().c_str());
  return selected->first;
}

// Neither --server nor --connect: spawn the server, run the client.
int RunLocal() {
  const std::string device = ResolveDevice();
  int port;
  const int listen_fd = ListenTcp("127.0.0.1", 0, &port);
  const pid_t child = SpawnSelf({
      "--server",
      absl::StrCat("--oob_fd=", listen_fd),
      absl::StrCat("--spawned_by=", getpid()),
      absl::StrCat("--device=", device),
      absl::StrCat("--server_core=", absl::GetFlag(FLAGS_server_core)),
      absl::StrCat("--ib_port=", absl::GetFlag(FLAGS_ib_port)),
      absl::StrCat("--gid_index=", absl::GetFlag(FLAGS_gid_index)),
      absl::StrCat("--timeout=", absl::GetFlag(FLAGS_timeout)),
      absl::StrCat("--mutex_deadlock_detection=",
                   absl::GetFlag(FLAGS_mutex_deadlock_detection) ? "true" : "false"),
      absl::StrCat("--link_key=", absl::GetFlag(FLAGS_link_key)),
  });
  const int fd = ConnectTcp("127.0.0.1", port, 10000);
  close(listen_fd);
  const int rc = RunClient(fd, device, absl::GetFlag(FLAGS_server_core));
  const int child_rc = WaitChild(child, 10000);
  if (child_rc != 0) Die("the server process exited with status %d", child_rc);
  return rc;
}

// ---- --raw: the shared-memory floor -------------------------------------------------------------

struct RawShared {
  alignas(64) std::atomic<uint64_t> line;   // the one cache line that ping-pongs
  alignas(64) std::atomic<uint64_t> ready;  // the child is pinned and spinning
};
constexpr uint64_t kRawStop = ~uint64_t{0};

RawShared* MapRaw(int fd) {
  void* p = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) Die("mmap shared memory: %s", std::strerror(errno));
  return static_cast<RawShared*>(p);
}

int RunRawChild() {
  PinOrDie(absl::GetFlag(FLAGS_server_core), "raw responder");
  RawShared* shm = MapRaw(absl::GetFlag(FLAGS_raw_fd));
  shm->ready.store(1, std::memory_order_release);
  uint64_t expect = 1;
  for (;;) {
    const uint64_t v = shm->line.load(std::memory_order_acquire);
    if (v == expect) {
      shm->line.store(v + 1, std::memory_order_release);
      expect += 2;
    } else if (v == kRawStop) {
      return 0;
    }
  }
}

int RunRaw() {
  const int fd = memfd_create("verbs_perf_raw", 0);  // inherited by the child
  if (fd < 0 || ftruncate(fd, 4096) != 0) Die("memfd: %s", std::strerror(errno));
  RawShared* shm = MapRaw(fd);
  const pid_t child = SpawnSelf({
      "--raw_child",
      absl::StrCat("--raw_fd=", fd),
      absl::StrCat("--spawned_by=", getpid()),
      absl::StrCat("--server_core=", absl::GetFlag(FLAGS_server_core)),
  });
  const int core = absl::GetFlag(FLAGS_client_core);
  PinOrDie(core, "client");
  {
    SpinGuard guard("the raw responder to start");
    while (shm->ready.load(std::memory_order_acquire) == 0) guard.Check();
  }
  const uint64_t iters = absl::GetFlag(FLAGS_iters) != 0 ? absl::GetFlag(FLAGS_iters) : 1000000;
  const uint64_t warmup = WarmupFor(iters);
  const uint64_t total = warmup + iters;
  std::vector<uint64_t> t(total + 1);
  for (uint64_t i = 0; i < total; ++i) {
    t[i] = Ticks();
    shm->line.store(2 * i + 1, std::memory_order_release);
    while (shm->line.load(std::memory_order_acquire) != 2 * i + 2) {
    }
  }
  t[total] = Ticks();
  shm->line.store(kRawStop, std::memory_order_release);
  const int child_rc = WaitChild(child, 10000);
  if (child_rc != 0) Die("the raw responder exited with status %d", child_rc);

  std::vector<uint64_t> rtt = Samples(t, warmup, iters);
  DumpSamples(rtt, 64, false);
  const LatencyStats s = ComputeLatency(rtt, TickClock::TicksPerUs());
  if (absl::GetFlag(FLAGS_json)) {
    std::string out = absl::StrFormat(
        "{\"test\":\"raw\",\"device\":\"shm\",\"size\":64,\"iters\":%d,\"warmup\":%d", iters,
        warmup);
    AppendLatencyJson(out, s);
    absl::StrAppendFormat(&out, ",\"client_core\":%d,\"server_core\":%d}", core,
                          absl::GetFlag(FLAGS_server_core));
    std::printf("%s\n", out.c_str());
  } else {
    std::printf("%s", kRule);
    std::printf("                    Shared-memory cache-line ping-pong (the floor)\n");
    std::printf(" Cores           : client %d, server %d\n", core,
                absl::GetFlag(FLAGS_server_core));
    std::printf("%s", kRule);
    std::printf(" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    "
                "t_avg[usec]    t_stdev[usec]   99%% percentile[usec]   99.9%% percentile[usec]\n");
    PrintLatencyRow(64, iters, s, 0.5);
    std::printf("%s", kRule);
    std::printf(" t_* are one-way latency = RTT/2; --json reports the round trip (rtt_*).\n");
  }
  return 0;
}

}  // namespace
}  // namespace swirl::bench

int main(int argc, char** argv) {
  using namespace swirl::bench;  // NOLINT
  absl::SetProgramUsageMessage(
      "perftest-style latency/bandwidth over swirl devices.\n"
      "  verbs_perf --test send_lat|write_lat|read_lat|send_bw|write_bw [--size N | -a] [--json]\n"
      "  verbs_perf --raw     (shared-memory floor)\n"
      "Without --server/--connect both sides run on this host in two pinned processes.");
  absl::ParseCommandLine(argc, argv);
  std::signal(SIGPIPE, SIG_IGN);
  DieWithParent();
  TickClock::Init();
  SetSpinTimeoutSeconds(absl::GetFlag(FLAGS_timeout));
  if (!absl::GetFlag(FLAGS_mutex_deadlock_detection)) {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }

  if (absl::GetFlag(FLAGS_raw_child)) return RunRawChild();
  if (absl::GetFlag(FLAGS_raw)) return RunRaw();
  if (absl::GetFlag(FLAGS_server)) return RunServer();
  if (!absl::GetFlag(FLAGS_connect).empty()) {
    ParseTest(absl::GetFlag(FLAGS_test));  // fail before connecting
    const int fd = ConnectTcp(absl::GetFlag(FLAGS_connect), absl::GetFlag(FLAGS_port), 30000);
    return RunClient(fd, absl::GetFlag(FLAGS_device), -1);
  }
  ParseTest(absl::GetFlag(FLAGS_test));
  return RunLocal();
}
