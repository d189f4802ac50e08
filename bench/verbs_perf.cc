// verbs_perf: a perftest-style latency and bandwidth tool over any swirl device (rdma-core or
// the soft device), and the cost of exposing memory per request (memory windows).
//
//   bazel-bin/bench/verbs_perf --test send_lat -s 64               # both sides on this host
//   bazel-bin/bench/verbs_perf --test write_bw -s 1048576 --json
//   bazel-bin/bench/verbs_perf --test write_lat -a                 # sizes 2 B .. 8 MiB
//   bazel-bin/bench/verbs_perf --test send_lat -D 2 -H             # 2 s, whole histogram
//   bazel-bin/bench/verbs_perf --raw                               # shared-memory floor
//   bazel-bin/bench/verbs_perf --test bind_inv -s 4096             # a window per transfer
//   bazel-bin/bench/verbs_perf --server --port 18515               # one side ...
//   bazel-bin/bench/verbs_perf --connect host --port 18515 --test read_lat   # ... the other
//
// Flags shared with the other tools (-s, -a, -n, -D, --warmup, --json, --out_json, --csv, -H,
// cores): bench/perf_common.h.
//
// The window tests time one exposed transfer per iteration, the client being the side that
// exposes its memory and the server the peer that uses it:
//   static_mr       the client sends the address and rkey of its one registered region; the
//                   server READs `size` bytes through it (--window_op write: WRITEs) and answers
//                   with a SEND: the transfer alone, nothing exposed per request (the baseline);
//   bind_inv        the client binds a type 2 window over exactly the buffer with a fresh key
//                   and sends that key; the server READs through it and answers with a
//                   SEND_WITH_INV of the key, which revokes the window on delivery (swirl's
//                   default; the receive completion is checked for IBV_WC_WITH_INV and the key);
//   bind_local_inv  the same, but the server answers with a plain SEND and the client revokes
//                   the window itself with a LOCAL_INV, waiting for its completion before the
//                   buffer may be reused (swirl's local-invalidation fallback);
//   reg_mr          the client registers a memory region over the buffer per transfer and
//                   deregisters it after the server's SEND (what windows replace).
// Each reports the round trip per transfer (rtt_*), transfers per second, and the client's
// own time in its window steps (posting the bind; the LOCAL_INV and its completion; the
// registration and deregistration): window_ns per window and windows_per_s_per_core = 1e9 /
// window_ns. What a step adds to a transfer's latency is its p50 minus static_mr's p50 (the
// same size, in the same run: bench/swirl_bench.py does it).
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
// round trip; JSON always reports round trips (rtt_*) and perftest's one-way keys beside them.
// With -D the client runs each size for that long and then tells the server, which waits
// without knowing the count (a wait that sees nothing for 1 ms looks at the out-of-band
// channel; never sooner, so the check costs the measurement nothing).
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
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "bench/perf_common.h"
#include "transport/device.h"
#include "transport/soft/soft_device.h"
#include "transport/verbs/verbs.h"

ABSL_FLAG(std::string, test, "send_lat",
          "send_lat|write_lat|read_lat|send_bw|write_bw, or a window test: "
          "static_mr|bind_inv|bind_local_inv|reg_mr");
ABSL_FLAG(std::string, window_op, "read",
          "window tests: how the server uses the exposed buffer (read: RDMA READ, as a swirl "
          "download; write: RDMA WRITE, as an upload)");
ABSL_FLAG(std::string, device, "",
          "device name (mlx5_0, soft0, ...); empty: swirl::OpenDevice's automatic choice");
ABSL_FLAG(bool, server, false, "run as the server side: wait for a client on --port");
ABSL_FLAG(std::string, connect, "", "run as the client side against a server on HOST");
ABSL_FLAG(int, port, 18515, "TCP port of the out-of-band exchange (--server / --connect)");
ABSL_FLAG(bool, raw, false,
          "measure the physical floor: two pinned processes ping-ponging one cache line "
          "through shared memory");
ABSL_FLAG(bool, inline, true,
          "post SENDs and WRITEs with IBV_SEND_INLINE when they fit the QP's max inline data");
ABSL_FLAG(uint32_t, inline_size, 220,
          "max inline data to ask the QP for (the device may grant less)");
ABSL_FLAG(uint32_t, tx_depth, 128,
          "bandwidth tests: work requests outstanding (--inflight sets it too)");
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

enum class Test : uint32_t {
  kSendLat = 1,
  kWriteLat,
  kReadLat,
  kSendBw,
  kWriteBw,
  kStaticMr,
  kBindInv,
  kBindLocalInv,
  kRegMr,
};

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
    {Test::kStaticMr, "static_mr", "Exposed transfer, one registered region (baseline)"},
    {Test::kBindInv, "bind_inv", "Exposed transfer, type 2 window revoked by SEND_WITH_INV"},
    {Test::kBindLocalInv, "bind_local_inv", "Exposed transfer, type 2 window revoked by LOCAL_INV"},
    {Test::kRegMr, "reg_mr", "Exposed transfer, memory region registered per transfer"},
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
bool IsWindow(Test t) {
  return t == Test::kStaticMr || t == Test::kBindInv || t == Test::kBindLocalInv ||
         t == Test::kRegMr;
}

constexpr uint32_t kLatSqDepth = 128;
constexpr uint32_t kLatCqMod = 64;
constexpr uint32_t kLatRxDepth = 64;

// ---- Out-of-band messages (both ends run this binary) -----------------------------------------

constexpr uint64_t kMagic = 0x3146524550535756ull;  // "VWSPERF1"
constexpr uint32_t kVersion = 2;

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
  uint32_t window_write;  // window tests: the server WRITEs instead of READing
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

// kStart with iters == 0: duration mode (the server runs until the client's kDone).
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

// What the exposing side (the client of a window test) sends per transfer.
struct WindowGrant {
  uint64_t addr;
  uint32_t rkey;
  uint32_t length;
};

// ---- One side's verbs resources -----------------------------------------------------------------

struct Endpoint {
  std::shared_ptr<verbs::Context> ctx;
  std::shared_ptr<verbs::ProtectionDomain> pd;
  std::shared_ptr<verbs::CompletionQueue> cq;
  std::unique_ptr<verbs::QueuePair> qp;
  std::unique_ptr<verbs::MemoryRegion> mr;
  std::unique_ptr<verbs::MemoryWindow> mw;  // window tests, on the client
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
  // The last receive completion's flags and invalidated key (window tests check them).
  unsigned int last_recv_flags = 0;
  uint32_t last_invalidated_rkey = 0;

  char* send_region() const { return buf; }
  char* recv_region() const { return buf + region; }

  ~Endpoint() {
    qp.reset();
    mw.reset();
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

constexpr int kRegionAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

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
      e.pd, e.buf, 2 * e.region, kRegionAccess | (IsWindow(test) ? IBV_ACCESS_MW_BIND : 0));
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
  e.rx_depth = test == Test::kSendBw                         ? std::max<uint32_t>(cfg.rx_depth, 2)
               : test == Test::kSendLat || IsWindow(test) ? kLatRxDepth
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
      e.last_recv_flags = wc[i].wc_flags;
      e.last_invalidated_rkey = wc[i].invalidated_rkey;
    } else {
      e.send_done = wc[i].wr_id + 1;  // signaled: everything before it has completed too
    }
  }
}

// Waits for send queue space, then posts `wr` (its wr_id and signaling set here). Returns the
// WR's sequence number.
inline uint64_t PostWr(Endpoint& e, ibv_send_wr& wr, bool force_signal) {
  if (e.send_seq - e.send_done >= e.sq_depth) {
    SpinGuard guard("send queue space");
    while (e.send_seq - e.send_done >= e.sq_depth) {
      PollOnce(e);
      guard.Check();
    }
  }
  const uint64_t id = e.send_seq++;
  wr.wr_id = id;
  if (force_signal || (id + 1) % e.cq_mod == 0) wr.send_flags |= IBV_SEND_SIGNALED;
  ibv_send_wr* bad = nullptr;
  if (int rc = ibv_post_send(e.raw_qp, &wr, &bad); rc != 0) {
    Die("ibv_post_send: %s", std::strerror(rc));
  }
  return id;
}

// Posts one SEND / RDMA WRITE (from the send region to the peer's receive region) or RDMA READ
// (from the peer's send region into the receive region). Returns the WR's sequence number.
inline uint64_t PostOne(Endpoint& e, ibv_wr_opcode op, uint32_t len, bool force_signal) {
  const bool read = op == IBV_WR_RDMA_READ;
  ibv_sge sge{reinterpret_cast<uint64_t>(read ? e.recv_region() : e.send_region()), len, e.lkey};
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = op;
  if (!read && len <= e.max_inline) wr.send_flags |= IBV_SEND_INLINE;
  if (op != IBV_WR_SEND) {
    wr.wr.rdma.remote_addr = e.remote_addr + (read ? 0 : e.remote_region);
    wr.wr.rdma.rkey = e.rkey;
  }
  return PostWr(e, wr, force_signal || read);
}

// Duration mode on the server, which does not know the count: a wait that has seen nothing
// for 1 ms looks at the out-of-band channel for the client's kDone (and never sooner, so in
// the steady state nothing but the device is touched).
class StopCheck {
 public:
  StopCheck() = default;  // count mode: never stops early
  explicit StopCheck(Oob* oob)
      : oob_(oob), interval_(static_cast<uint64_t>(1000 * TickClock::RoughTicksPerUs())) {}
  bool stopped() const { return stopped_; }
  // Call in a wait loop; `since` is when the wait began (or last checked).
  bool Check(uint64_t& since) {
    if (oob_ == nullptr) return false;
    const uint64_t now = Ticks();
    if (now - since < interval_) return false;
    since = now;
    WireMsg m;
    if (!oob_->TryRecv(&m, sizeof(m))) return false;
    Expect(m, kDone);
    stopped_ = true;
    return true;
  }

 private:
  Oob* oob_ = nullptr;
  uint64_t interval_ = 0;
  bool stopped_ = false;
};

// Returns false if the wait ended because the client is done (duration mode).
bool WaitRecvs(Endpoint& e, uint64_t target, StopCheck* stop = nullptr) {
  if (e.recv_done >= target) return true;
  SpinGuard guard("a receive completion");
  uint64_t since = Ticks();
  while (e.recv_done < target) {
    PollOnce(e);
    if (stop != nullptr && stop->Check(since)) return false;
    if (stop == nullptr || !stop->stopped()) guard.Check();
  }
  return true;
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

// Spins on the byte at `p` until it reads `v`, making progress meanwhile. False: the client is
// done (duration mode).
inline bool WaitByte(Endpoint& e, const char* p, char v, StopCheck* stop = nullptr) {
  if (__atomic_load_n(p, __ATOMIC_ACQUIRE) == v) return true;
  SpinGuard guard("the peer's RDMA WRITE");
  uint64_t since = Ticks();
  while (__atomic_load_n(p, __ATOMIC_ACQUIRE) != v) {
    PollOnce(e);
    if (stop != nullptr && stop->Check(since)) return false;
    guard.Check();
  }
  return true;
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

// ---- Iteration control: a count, or a duration --------------------------------------------------

// Decides, before each iteration, whether it is warm-up, measured, or the last one.
class Schedule {
 public:
  static constexpr uint64_t kMinSamples = 100;
  // Count mode: `warmup` untimed iterations, then `iters` timed ones.
  static Schedule Count(uint64_t warmup, uint64_t iters) {
    Schedule s;
    s.warmup_ = warmup;
    s.total_ = warmup + iters;
    return s;
  }
  // Duration mode: untimed until `warmup_s` has passed (or `warmup` iterations, if >= 0), then
  // timed for `seconds` and at least kMinSamples iterations.
  static Schedule Duration(double seconds, double warmup_s, int64_t warmup) {
    Schedule s;
    s.duration_ = true;
    const double tpu = TickClock::RoughTicksPerUs();
    s.start_ = Ticks();
    s.warm_end_ = s.start_ + static_cast<uint64_t>(warmup_s * 1e6 * tpu);
    s.warmup_by_count_ = warmup >= 0;
    s.warmup_ = warmup >= 0 ? static_cast<uint64_t>(warmup) : 0;
    s.span_.emplace(seconds);
    return s;
  }

  bool duration() const { return duration_; }
  // Before iteration i (at time `now`, with `measured_ticks` of samples so far): is it timed?
  // Sets last() when it is the final one.
  bool Timed(uint64_t i, uint64_t now, uint64_t measured_ticks) {
    if (!duration_) {
      last_ = i + 1 == total_;
      return i >= warmup_;
    }
    bool timed;
    if (warmup_by_count_) {
      timed = i >= warmup_;
    } else {
      timed = now >= warm_end_;
    }
    if (timed && measure_start_ == 0) {
      measure_start_ = now;
      first_timed_ = i;
    }
    // At least kMinSamples: a run that stalls (the host took a core away) still has a
    // distribution, not one sample.
    // The span is measured time, what the report's "seconds" adds up, not the wall clock.
    last_ = timed && i + 1 - first_timed_ >= kMinSamples && span_->Covered(measured_ticks);
    return timed;
  }
  bool last() const { return last_; }
  uint64_t total() const { return total_; }  // count mode only
  // Iterations before the first timed one.
  uint64_t warmup_done(uint64_t i_end) const {
    return duration_ ? (measure_start_ == 0 ? i_end : first_timed_) : warmup_;
  }

 private:
  bool duration_ = false;
  bool warmup_by_count_ = true;
  uint64_t warmup_ = 0, total_ = 0;
  uint64_t start_ = 0, warm_end_ = 0, measure_start_ = 0, first_timed_ = 0;
  std::optional<MeasuredSpan> span_;  // duration mode
  bool last_ = false;
};

// ---- Client roles ----------------------------------------------------------------------------

struct Result {
  Test test;
  uint64_t size = 0, iters = 0, warmup = 0;
  double seconds = 0;
  bool has_latency = false;
  Histogram rtt_ns;
  double bytes_per_s = 0, ops_per_s = 0, peak_bytes_per_s = 0;
  double window_ns = 0;  // window tests: the client's time in its window steps, per window
};

// Runs a ping-pong: `step(i, last)` is one iteration (it posts, then waits for the answer).
// A sample is the time from one iteration's start to the next one's.
template <typename Step>
Result PingPong(Test test, uint64_t size, Schedule sched, Step step) {
  LatencyRecorder recorder;
  const std::string samples = absl::GetFlag(FLAGS_samples_out);
  if (!samples.empty()) {
    recorder.WriteSamplesTo(HarnessSizes().size() > 1 ? absl::StrCat(samples, ".", size)
                                                      : samples);
  }
  uint64_t prev = Ticks();
  uint64_t measured = 0, measured_ticks = 0;
  uint64_t i = 0;
  for (;; ++i) {
    const bool timed = sched.Timed(i, prev, measured_ticks);
    step(i, sched.last());
    const uint64_t now = Ticks();
    if (timed) {
      ++measured;
      measured_ticks += now - prev;
      if (recorder.Add(now - prev)) {
        prev = Ticks();  // the flush is no latency
        if (sched.last()) break;
        continue;
      }
    }
    prev = now;
    if (sched.last()) break;
  }
  Result r;
  r.test = test;
  r.size = size;
  r.iters = measured;
  r.warmup = sched.warmup_done(i + 1);
  r.has_latency = true;
  r.rtt_ns = recorder.histogram();
  r.seconds = static_cast<double>(measured_ticks) / TickClock::TicksPerUs() / 1e6;
  r.ops_per_s = r.seconds > 0 ? static_cast<double>(measured) / r.seconds : 0;
  return r;
}

Result ClientSendLat(Endpoint& e, uint32_t size, Schedule sched) {
  const uint64_t base = e.recv_done;
  uint64_t repost = 0;
  Result r = PingPong(Test::kSendLat, size, sched, [&](uint64_t i, bool last) {
    PostOne(e, IBV_WR_SEND, size, last);
    if (repost != 0) {  // while the message is in flight; many receives stay posted
      PostRecvs(e, repost);
      repost = 0;
    }
    WaitRecvs(e, base + i + 1);
    repost = 1;
  });
  PostRecvs(e, repost);
  DrainSends(e);
  return r;
}

Result ClientWriteLat(Endpoint& e, uint32_t size, Schedule sched) {
  char* src = e.send_region() + size - 1;
  const char* mine = e.recv_region() + size - 1;
  Result r = PingPong(Test::kWriteLat, size, sched, [&](uint64_t i, bool last) {
    const char v = IterByte(i);
    *src = v;
    PostOne(e, IBV_WR_RDMA_WRITE, size, last);
    WaitByte(e, mine, v);
  });
  DrainSends(e);
  return r;
}

Result ClientReadLat(Endpoint& e, uint32_t size, Schedule sched) {
  return PingPong(Test::kReadLat, size, sched, [&](uint64_t, bool) {
    const uint64_t id = PostOne(e, IBV_WR_RDMA_READ, size, true);
    WaitSends(e, id + 1);
  });
}

// ---- Window tests: the client exposes, the server uses -------------------------------------------

uint32_t NextKey(uint32_t rkey) {
  // A fresh 8-bit key each time (never the one just revoked), as swirl's workers pick them.
  return ibv_inc_rkey(rkey);
}

Result ClientWindow(Endpoint& e, Test test, uint32_t size, Schedule sched) {
  const uint64_t base = e.recv_done;
  uint64_t repost = 0;
  uint64_t window_ticks = 0;
  uint32_t key = e.mw != nullptr ? e.mw->rkey() : 0;
  const uint64_t buffer = reinterpret_cast<uint64_t>(e.send_region());
  Result r = PingPong(test, size, sched, [&](uint64_t i, bool last) {
    // 1. Expose the buffer.
    std::unique_ptr<verbs::MemoryRegion> per_transfer;
    uint32_t rkey = e.mr->rkey();
    if (test == Test::kBindInv || test == Test::kBindLocalInv) {
      key = NextKey(key);
      ibv_send_wr bind{};
      bind.opcode = IBV_WR_BIND_MW;
      bind.bind_mw.mw = e.mw->get();
      bind.bind_mw.rkey = key;
      bind.bind_mw.bind_info.mr = e.mr->get();
      bind.bind_mw.bind_info.addr = buffer;
      bind.bind_mw.bind_info.length = size;
      bind.bind_mw.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
      const uint64_t t0 = Ticks();
      PostWr(e, bind, false);  // unsignaled, as swirl binds: the SEND behind it is ordered
      window_ticks += Ticks() - t0;
      rkey = key;
    } else if (test == Test::kRegMr) {
      const uint64_t t0 = Ticks();
      auto mr = verbs::MemoryRegion::Register(e.pd, e.send_region(), size, kRegionAccess);
      window_ticks += Ticks() - t0;
      if (!mr.ok()) Die("%s", mr.status().ToString().c_str());
      per_transfer = std::move(*mr);
      rkey = per_transfer->rkey();
    }
    // 2. Grant it (an inline SEND), then wait for the server's answer.
    WindowGrant grant{buffer, rkey, size};
    ibv_sge sge{reinterpret_cast<uint64_t>(&grant), sizeof(grant), 0};
    ibv_send_wr send{};
    send.opcode = IBV_WR_SEND;
    send.sg_list = &sge;
    send.num_sge = 1;
    send.send_flags = IBV_SEND_INLINE;
    if (e.max_inline < sizeof(grant)) {
      std::memcpy(e.send_region() + e.region - sizeof(grant), &grant, sizeof(grant));
      sge.addr = reinterpret_cast<uint64_t>(e.send_region() + e.region - sizeof(grant));
      sge.lkey = e.lkey;
      send.send_flags = 0;
    }
    PostWr(e, send, last);
    if (repost != 0) {
      PostRecvs(e, repost);
      repost = 0;
    }
    WaitRecvs(e, base + i + 1);
    repost = 1;
    const bool with_inv = (e.last_recv_flags & IBV_WC_WITH_INV) != 0;
    if (test == Test::kBindInv) {
      // The point of the test: the answer revoked exactly this window.
      if (!with_inv || e.last_invalidated_rkey != rkey) {
        Die("the server's answer did not invalidate window 0x%x (flags 0x%x, key 0x%x)", rkey,
            e.last_recv_flags, e.last_invalidated_rkey);
      }
    } else if (with_inv) {
      Die("unexpected SEND_WITH_INV in %s", TestName(test));
    }
    // 3. Revoke it, where the answer did not.
    if (test == Test::kBindLocalInv) {
      ibv_send_wr inv{};
      inv.opcode = IBV_WR_LOCAL_INV;
      inv.invalidate_rkey = rkey;
      const uint64_t t0 = Ticks();
      const uint64_t id = PostWr(e, inv, true);
      WaitSends(e, id + 1);  // the buffer is not ours again before this completes
      window_ticks += Ticks() - t0;
    } else if (test == Test::kRegMr) {
      const uint64_t t0 = Ticks();
      if (auto s = per_transfer->Deregister(); !s.ok()) Die("%s", s.ToString().c_str());
      per_transfer.reset();
      window_ticks += Ticks() - t0;
    }
  });
  PostRecvs(e, repost);
  DrainSends(e);
  const uint64_t windows = r.iters + r.warmup;
  if (test != Test::kStaticMr && windows > 0) {
    r.window_ns = static_cast<double>(window_ticks) * 1000.0 / TickClock::TicksPerUs() /
                  static_cast<double>(windows);
  }
  r.bytes_per_s = r.ops_per_s * size;
  return r;
}

// The server's side of a window test: per grant, READ (or WRITE) through it, then answer with
// SEND_WITH_INV of its key (bind_inv) or a plain SEND.
void ServerWindow(Endpoint& e, Test test, uint32_t size, bool write, uint64_t total,
                  StopCheck* stop) {
  const uint64_t base = e.recv_done;
  for (uint64_t i = 0; total == 0 || i < total; ++i) {
    if (!WaitRecvs(e, base + i + 1, stop)) return;
    WindowGrant grant;
    std::memcpy(&grant, e.recv_region(), sizeof(grant));
    PostRecvs(e, 1);
    if (grant.length != size) Die("window grant of %u bytes, expected %u", grant.length, size);
    ibv_sge sge{reinterpret_cast<uint64_t>(write ? e.send_region() : e.recv_region()), size,
                e.lkey};
    ibv_send_wr use{};
    use.opcode = write ? IBV_WR_RDMA_WRITE : IBV_WR_RDMA_READ;
    use.sg_list = &sge;
    use.num_sge = 1;
    use.wr.rdma.remote_addr = grant.addr;
    use.wr.rdma.rkey = grant.rkey;
    if (write && size <= e.max_inline) use.send_flags |= IBV_SEND_INLINE;
    const uint64_t id = PostWr(e, use, !write);
    // A READ must be complete before the key is revoked; a WRITE is ordered before the SEND.
    if (!write) WaitSends(e, id + 1);
    ibv_send_wr answer{};
    answer.opcode = test == Test::kBindInv ? IBV_WR_SEND_WITH_INV : IBV_WR_SEND;
    if (test == Test::kBindInv) answer.invalidate_rkey = grant.rkey;
    PostWr(e, answer, total != 0 && i + 1 == total);
  }
}

// tx_depth outstanding, one signaled WR in cq_mod (and the last). Completion times are those of
// the signaled completion that covered each WR. Count mode: n WRs; duration mode (n == 0):
// until `deadline`.
void BwPhase(Endpoint& e, ibv_wr_opcode op, uint32_t size, uint64_t n, uint64_t deadline,
             std::vector<uint64_t>* tposted, std::vector<uint64_t>* tcompleted) {
  const uint64_t base = e.send_seq;
  uint64_t posted = 0, done = 0;
  bool stop_posting = false;
  SpinGuard guard("bandwidth completions");
  while (!stop_posting || done < posted) {
    while (!stop_posting && posted - done < e.sq_depth) {
      const uint64_t now = Ticks();
      const bool last = n != 0 ? posted + 1 == n : now >= deadline;
      if (tposted != nullptr) tposted->push_back(now);
      PostOne(e, op, size, last);
      ++posted;
      stop_posting = last;
    }
    PollOnce(e);
    const uint64_t now_done = e.send_done - base;
    if (now_done != done) {
      if (tcompleted != nullptr) {
        const uint64_t now = Ticks();
        for (uint64_t j = done; j < now_done; ++j) tcompleted->push_back(now);
      }
      done = now_done;
      guard = SpinGuard("bandwidth completions");
    }
    guard.Check();
  }
}

Result ClientBw(Endpoint& e, Test test, uint32_t size, uint64_t iters, uint64_t warmup,
                double duration) {
  const ibv_wr_opcode op = test == Test::kSendBw ? IBV_WR_SEND : IBV_WR_RDMA_WRITE;
  const double tpu = TickClock::RoughTicksPerUs();
  if (duration > 0) {
    const int64_t w = HarnessWarmupFlag();
    if (w > 0) {
      BwPhase(e, op, size, static_cast<uint64_t>(w), 0, nullptr, nullptr);
    } else if (w < 0) {
      BwPhase(e, op, size, 0, Ticks() + static_cast<uint64_t>(0.1 * duration * 1e6 * tpu),
              nullptr, nullptr);
    }
    warmup = w >= 0 ? static_cast<uint64_t>(w) : 0;
  } else if (warmup > 0) {
    BwPhase(e, op, size, warmup, 0, nullptr, nullptr);
  }
  std::vector<uint64_t> tposted, tcompleted;
  tposted.reserve(duration > 0 ? 1 << 20 : iters);
  tcompleted.reserve(duration > 0 ? 1 << 20 : iters);
  const uint64_t deadline =
      duration > 0 ? Ticks() + static_cast<uint64_t>(duration * 1e6 * tpu) : 0;
  BwPhase(e, op, size, duration > 0 ? 0 : iters, deadline, &tposted, &tcompleted);
  iters = tposted.size();
  const double tpu_exact = TickClock::TicksPerUs();
  Result r;
  r.test = test;
  r.size = size;
  r.iters = iters;
  r.warmup = warmup;
  const double span_us = static_cast<double>(tcompleted[iters - 1] - tposted[0]) / tpu_exact;
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
    const double us = static_cast<double>(tcompleted[i + w - 1] - start) / tpu_exact;
    if (us > 0) best_us = std::min(best_us, us);
  }
  r.peak_bytes_per_s = std::max(static_cast<double>(w) * size / (best_us / 1e6), r.bytes_per_s);
  return r;
}

Result ClientRun(Endpoint& e, Test test, uint32_t size, uint64_t iters, uint64_t warmup) {
  const double duration = HarnessDuration();
  if (IsBw(test)) return ClientBw(e, test, size, iters, warmup, duration);
  const Schedule sched =
      duration > 0 ? Schedule::Duration(duration, 0.1 * duration, HarnessWarmupFlag())
                   : Schedule::Count(warmup, iters);
  switch (test) {
    case Test::kSendLat: return ClientSendLat(e, size, sched);
    case Test::kWriteLat: return ClientWriteLat(e, size, sched);
    case Test::kReadLat: return ClientReadLat(e, size, sched);
    default: return ClientWindow(e, test, size, sched);
  }
}

// Zeroes the byte write_lat polls, before the peer can write it.
void Prepare(Endpoint& e, Test test, uint64_t size) {
  if (test == Test::kWriteLat) {
    __atomic_store_n(e.recv_region() + size - 1, static_cast<char>(0), __ATOMIC_RELEASE);
  }
}

// ---- Server roles ----------------------------------------------------------------------------

// `total` iterations, or (total == 0) until `stop` sees the client's kDone.
void ServerRun(Endpoint& e, Test test, uint32_t size, uint64_t total, bool window_write,
               StopCheck* stop) {
  const bool until_done = total == 0;
  switch (test) {
    case Test::kSendLat: {
      const uint64_t base = e.recv_done;
      for (uint64_t i = 0; until_done || i < total; ++i) {
        if (!WaitRecvs(e, base + i + 1, stop)) break;
        PostOne(e, IBV_WR_SEND, size, !until_done && i + 1 == total);
        PostRecvs(e, 1);
      }
      // Duration mode: the last SEND may be unsignaled; the next size's first signaled WR
      // retires it.
      if (!until_done) DrainSends(e);
      break;
    }
    case Test::kWriteLat: {
      char* src = e.send_region() + size - 1;
      const char* mine = e.recv_region() + size - 1;
      for (uint64_t i = 0; until_done || i < total; ++i) {
        const char v = IterByte(i);
        if (!WaitByte(e, mine, v, stop)) break;
        *src = v;
        PostOne(e, IBV_WR_RDMA_WRITE, size, !until_done && i + 1 == total);
      }
      if (!until_done) DrainSends(e);
      break;
    }
    case Test::kSendBw: {
      const uint64_t target = until_done ? UINT64_MAX : e.recv_done + total;
      SpinGuard guard("SENDs from the client");
      uint64_t last = e.recv_done;
      uint64_t since = Ticks();
      while (e.recv_done < target) {
        PollOnce(e);
        const uint64_t outstanding = e.recv_posted - e.recv_done;
        if (outstanding <= e.rx_depth / 2) PostRecvs(e, e.rx_depth - outstanding);
        if (e.recv_done != last) {
          last = e.recv_done;
          since = Ticks();
          guard = SpinGuard("SENDs from the client");
        }
        if (stop != nullptr && stop->Check(since)) break;
        guard.Check();
      }
      PostRecvs(e, e.rx_depth - (e.recv_posted - e.recv_done));
      break;
    }
    case Test::kStaticMr:
    case Test::kBindInv:
    case Test::kBindLocalInv:
    case Test::kRegMr:
      ServerWindow(e, test, size, window_write, total, stop);
      break;
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
  bool window_write = false;
};

ResultRow ToRow(const RunInfo& info, Result& r) {
  ResultRow row;
  row.test = TestName(r.test);
  row.size = r.size;
  row.iters = r.iters;
  row.warmup = r.warmup;
  row.seconds = r.seconds;
  const bool inlined = info.use_inline && r.test != Test::kReadLat && !IsWindow(r.test) &&
                       r.size <= info.max_inline;
  row.AddBool("inline", inlined);
  if (IsBw(r.test)) {
    row.ops_per_s = r.ops_per_s;
    row.bytes_per_s = r.bytes_per_s;
    row.peak_bytes_per_s = r.peak_bytes_per_s;
    row.AddInt("tx_depth", info.tx_depth);
    row.AddInt("cq_mod", info.cq_mod);
  } else {
    row.has_latency = true;
    row.rtt_ns = std::move(r.rtt_ns);
    row.one_way_divisor = r.test == Test::kReadLat || IsWindow(r.test) ? 1 : 2;
    row.ops_per_s = r.ops_per_s;
  }
  if (IsWindow(r.test)) {
    row.bytes_per_s = r.bytes_per_s;
    row.Add("window_op", info.window_write ? "write" : "read");
    if (r.test != Test::kStaticMr) {
      row.Add("window_ns", r.window_ns);
      row.Add("windows_per_s_per_core", r.window_ns > 0 ? 1e9 / r.window_ns : 0);
      row.notes.push_back(absl::StrFormat(
          "the client's own window steps: %.0f ns per window, %.0f windows/s per core; %.0f "
          "exposed transfers/s end to end",
          r.window_ns, r.window_ns > 0 ? 1e9 / r.window_ns : 0, r.ops_per_s));
    } else {
      row.notes.push_back(absl::StrFormat("%.0f transfers/s end to end", r.ops_per_s));
    }
  }
  return row;
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
  if (IsWindow(info.test)) {
    std::printf(" Window use      : the server %s the exposed buffer\n",
                info.window_write ? "RDMA WRITEs" : "RDMA READs");
  } else if (info.test == Test::kReadLat) {
    std::printf(" Inline data     : not used by RDMA READ\n");
  } else if (info.use_inline && info.max_inline > 0) {
    std::printf(" Inline data     : up to %u bytes\n", info.max_inline);
  } else {
    std::printf(" Inline data     : off\n");
  }
  std::printf(" Cores           : client %d, server %d\n", info.client_core, info.server_core);
  if (HarnessDuration() > 0) std::printf(" Duration        : %.3g s per size\n", HarnessDuration());
  if (!all) std::printf(" Message size    : %lu\n", static_cast<unsigned long>(size));
  std::printf("%s", kRule);
  if (IsBw(info.test)) {
    Report::PrintBwHeader();
  } else {
    Report::PrintLatencyHeader();
  }
  std::fflush(stdout);
}

void PrintFooter(Test test) {
  std::printf("%s", kRule);
  if (IsBw(test)) {
    std::printf(" MB = 2^20 bytes (as perftest); --json reports gbytes_per_s with GB = 1e9.\n");
  } else if (test == Test::kReadLat || IsWindow(test)) {
    std::printf(" t_* and percentiles are full round trips (perftest does not halve READ\n"
                " latency); the RTT columns are the same; --json reports rtt_* in microseconds.\n");
  } else {
    std::printf(" t_* and percentiles left of '|' are one-way latency = RTT/2, as perftest\n"
                " prints it; right of '|' the round trip. --json reports rtt_* (round trip).\n");
  }
}

// ---- Sizes and iteration counts -----------------------------------------------------------------

uint64_t AutoIters(Test test, uint64_t size) {
  if (IsBw(test)) return std::clamp<uint64_t>((2ull << 30) / size, 200, 100000);
  if (IsWindow(test)) return std::clamp<uint64_t>((64ull << 20) / size, 100, 20000);
  return std::clamp<uint64_t>((256ull << 20) / size, 100, 100000);
}

Test ParseTest(const std::string& name) {
  for (const auto& e : kTests) {
    if (name == e.name) return e.test;
  }
  Die("unknown --test '%s' (send_lat, write_lat, read_lat, send_bw, write_bw, static_mr, "
      "bind_inv, bind_local_inv, reg_mr)",
      name.c_str());
}

// Flags the chosen test cannot honour fail before anything starts.
void CheckHarnessFlags(Test test) {
  if (HarnessThreads() != 1) {
    Die("--threads: verbs_perf runs one QP per process pair (run more pairs for more)");
  }
  if (HarnessInflight(1) > 1 && !IsBw(test)) {
    Die("--inflight: a latency test keeps one message in flight; the _bw tests take "
        "--inflight (or --tx_depth)");
  }
  if (absl::GetFlag(FLAGS_window_op) != "read" && absl::GetFlag(FLAGS_window_op) != "write") {
    Die("--window_op must be read or write");
  }
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
  const int core = ServerCore();
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
    const bool until_done = m.iters == 0;
    StopCheck stop = until_done ? StopCheck(&oob) : StopCheck();
    ServerRun(e, test, static_cast<uint32_t>(m.size), until_done ? 0 : m.warmup + m.iters,
              cfg.window_write != 0, &stop);
    if (!stop.stopped()) Expect(ProgressUntilMessage(e, oob), kDone);
    oob.SendMsg(Msg(kDoneAck));
  }
  oob.SendMsg(Msg(kByeAck));
  return 0;
}

int RunClient(int fd, const std::string& device, int server_core_hint) {
  const int core = ClientCore();
  PinOrDie(core, "client");
  Oob oob(fd);
  const Test test = ParseTest(absl::GetFlag(FLAGS_test));
  const std::vector<uint64_t> sizes = HarnessSizes();
  for (uint64_t s : sizes) {
    if (s == 0 || s > (1ull << 30)) Die("--size must be 1 .. 2^30");
    if (IsWindow(test) && s < sizeof(WindowGrant)) {
      Die("window tests need --size >= %zu", sizeof(WindowGrant));
    }
  }
  WireConfig cfg{};
  cfg.magic = kMagic;
  cfg.version = kVersion;
  cfg.test = static_cast<uint32_t>(test);
  cfg.max_size = *std::max_element(sizes.begin(), sizes.end());
  cfg.tx_depth = static_cast<uint32_t>(
      HarnessInflight(static_cast<int>(absl::GetFlag(FLAGS_tx_depth))));
  cfg.cq_mod = absl::GetFlag(FLAGS_cq_mod);
  cfg.rx_depth = absl::GetFlag(FLAGS_rx_depth);
  cfg.use_inline = absl::GetFlag(FLAGS_inline) ? 1 : 0;
  cfg.inline_size = absl::GetFlag(FLAGS_inline_size);
  cfg.window_write = absl::GetFlag(FLAGS_window_op) == "write" ? 1 : 0;
  oob.SendMsg(cfg);

  Endpoint e;
  Setup(e, device, cfg);
  if (test == Test::kBindInv || test == Test::kBindLocalInv) {
    auto mw = verbs::MemoryWindow::Allocate(e.pd, IBV_MW_TYPE_2);
    if (!mw.ok()) Die("%s", mw.status().ToString().c_str());
    e.mw = std::move(*mw);
  }
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
  info.window_write = cfg.window_write != 0;

  Report report("verbs_perf");
  report.SetContext({{"device", absl::StrCat("\"", JsonEscape(info.device), "\"")},
                     {"client_core", absl::StrCat(info.client_core)},
                     {"server_core", absl::StrCat(info.server_core)}});
  const bool all = sizes.size() > 1;
  if (report.text()) PrintHeader(info, all, sizes[0]);
  const bool duration = HarnessDuration() > 0;
  for (uint64_t size : sizes) {
    const uint64_t iters = HarnessIters(AutoIters(test, size));
    const uint64_t warmup = HarnessWarmup(iters);
    Prepare(e, test, size);
    oob.SendMsg(duration ? Msg(kStart, size, 0, 0) : Msg(kStart, size, iters, warmup));
    Expect(oob.RecvMsg<WireMsg>(), kReady);
    Result r = ClientRun(e, test, static_cast<uint32_t>(size), iters, warmup);
    oob.SendMsg(Msg(kDone));
    Expect(oob.RecvMsg<WireMsg>(), kDoneAck);
    report.Row(ToRow(info, r));
  }
  oob.SendMsg(Msg(kBye));
  Expect(oob.RecvMsg<WireMsg>(), kByeAck);
  if (report.text()) PrintFooter(test);
  report.Finish();
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
      absl::StrCat("--server_core=", ServerCore()),
      absl::StrCat("--ib_port=", absl::GetFlag(FLAGS_ib_port)),
      absl::StrCat("--gid_index=", absl::GetFlag(FLAGS_gid_index)),
      absl::StrCat("--timeout=", absl::GetFlag(FLAGS_timeout)),
      absl::StrCat("--mutex_deadlock_detection=",
                   absl::GetFlag(FLAGS_mutex_deadlock_detection) ? "true" : "false"),
      absl::StrCat("--link_key=", absl::GetFlag(FLAGS_link_key)),
  });
  const int fd = ConnectTcp("127.0.0.1", port, 10000);
  close(listen_fd);
  const int rc = RunClient(fd, device, ServerCore());
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
  PinOrDie(ServerCore(), "raw responder");
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
      absl::StrCat("--server_core=", ServerCore()),
  });
  const int core = ClientCore();
  PinOrDie(core, "client");
  {
    SpinGuard guard("the raw responder to start");
    while (shm->ready.load(std::memory_order_acquire) == 0) guard.Check();
  }
  const uint64_t iters = HarnessIters(1000000);
  const double duration = HarnessDuration();
  const Schedule sched = duration > 0
                             ? Schedule::Duration(duration, 0.1 * duration, HarnessWarmupFlag())
                             : Schedule::Count(HarnessWarmup(iters), iters);
  Result r = PingPong(Test::kSendLat, 64, sched, [&](uint64_t i, bool) {
    shm->line.store(2 * i + 1, std::memory_order_release);
    while (shm->line.load(std::memory_order_acquire) != 2 * i + 2) {
    }
  });
  shm->line.store(kRawStop, std::memory_order_release);
  const int child_rc = WaitChild(child, 10000);
  if (child_rc != 0) Die("the raw responder exited with status %d", child_rc);

  ResultRow row;
  row.test = "raw";
  row.size = 64;
  row.iters = r.iters;
  row.warmup = r.warmup;
  row.seconds = r.seconds;
  row.has_latency = true;
  row.rtt_ns = std::move(r.rtt_ns);
  row.ops_per_s = r.ops_per_s;
  Report report("verbs_perf");
  report.SetContext({{"device", "\"shm\""},
                     {"client_core", absl::StrCat(core)},
                     {"server_core", absl::StrCat(ServerCore())}});
  if (report.text()) {
    std::printf("%s", kRule);
    std::printf("                    Shared-memory cache-line ping-pong (the floor)\n");
    std::printf(" Cores           : client %d, server %d\n", core, ServerCore());
    std::printf("%s", kRule);
    Report::PrintLatencyHeader();
  }
  report.Row(std::move(row));
  if (report.text()) {
    std::printf("%s", kRule);
    std::printf(" Left of '|' one-way latency = RTT/2; right of it the round trip; --json reports\n"
                " the round trip (rtt_*).\n");
  }
  report.Finish();
  return 0;
}

}  // namespace
}  // namespace swirl::bench

int main(int argc, char** argv) {
  using namespace swirl::bench;  // NOLINT
  ParseHarnessCommandLine(
      argc, argv,
      "perftest-style latency/bandwidth over swirl devices, and the cost of a memory window.\n"
      "  verbs_perf --test send_lat|write_lat|read_lat|send_bw|write_bw [-s N | -a] [-n N | -D S]\n"
      "  verbs_perf --test static_mr|bind_inv|bind_local_inv|reg_mr [-s N] [--window_op write]\n"
      "  verbs_perf --raw     (shared-memory floor)\n"
      "  [--json | --csv] [--out_json [--out_json_file F]] [-H]\n"
      "Without --server/--connect both sides run on this host in two pinned processes.");
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
  const Test test = ParseTest(absl::GetFlag(FLAGS_test));  // fail before connecting
  CheckHarnessFlags(test);
  if (!absl::GetFlag(FLAGS_connect).empty()) {
    const int fd = ConnectTcp(absl::GetFlag(FLAGS_connect), absl::GetFlag(FLAGS_port), 30000);
    return RunClient(fd, absl::GetFlag(FLAGS_device), -1);
  }
  return RunLocal();
}
