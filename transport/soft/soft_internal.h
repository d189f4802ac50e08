// Internal objects of the soft device. Nothing here is part of swirl's API: applications see
// only libibverbs structures (each object below derives from one) and soft_device.h.

#ifndef SWIRL_TRANSPORT_SOFT_SOFT_INTERNAL_H_
#define SWIRL_TRANSPORT_SOFT_SOFT_INTERNAL_H_

#include <infiniband/verbs.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "base/log_limiter.h"
#include "absl/status/status.h"
#include "base/mutex.h"
#include "base/spinlock.h"
#include "transport/soft/key_table.h"
#include "transport/soft/link_auth.h"
#include "transport/soft/ring.h"
#include "transport/soft/soft_device.h"
#include "transport/soft/wire.h"

namespace swirl::soft {

class Fabric;
struct Hca;
struct QpFaults;
struct SoftContext;
struct SoftCq;
struct SoftQp;

// ---- Limits reported by query_device (and enforced) ------------------------------------------

inline constexpr uint32_t kMaxQpWr = 16384;
inline constexpr uint32_t kMaxSge = 16;
inline constexpr uint32_t kMaxInline = 1024;
inline constexpr uint32_t kMaxCqe = (1u << 22) - 1;  // as mlx5's
inline constexpr uint32_t kMaxQp = 65536;
inline constexpr uint32_t kMaxCq = 65536;
inline constexpr uint32_t kMaxMr = KeyTable::kSlots / 2;
inline constexpr uint32_t kMaxMw = KeyTable::kSlots / 2;
inline constexpr uint32_t kMaxPd = 65536;
inline constexpr uint32_t kMaxSrq = 4096;
// Workers size their SRQ by the connections they admit (a floor of credits each, rpc/
// credit_ledger.h): 10,000 connections take about 42,000 entries.
inline constexpr uint32_t kMaxSrqWr = 1u << 17;
inline constexpr uint32_t kMaxRdAtomic = 128;
inline constexpr uint64_t kMaxMsgSize = 1ull << 31;
inline constexpr uint64_t kMaxMrSize = 1ull << 40;

// ---- Simple objects ---------------------------------------------------------------------------

struct SoftPd : ibv_pd {
  SoftContext* sctx;
  // MRs, MWs, QPs and SRQs of this PD: ibv_dealloc_pd fails with EBUSY while any exists (as the
  // kernel's uverbs does). Protection checks compare PD addresses, so a PD freed under its
  // objects would lend them to the next PD allocated at that address.
  std::atomic<uint32_t> users{0};
};

struct SoftMr : ibv_mr {
  KeyEntry* entry;
};

struct SoftMw : ibv_mw {
  KeyEntry* entry;  // the slot the window's binding lives in (type 2: its latest bind's)
  // Type 2: a bind may move the window to a fresh random slot (memory.cc, PrepareType2Bind).
  // `next` is the slot FreshWindowRkey reserved, where a bind whose rkey names it lands;
  // `left` the slots the window moved out of that may still hold its binding (each with the
  // generation it had then). Under Hca::mw_mu.
  KeyEntry* next = nullptr;
  std::vector<std::pair<KeyEntry*, uint64_t>> left;
};

struct SoftChannel : ibv_comp_channel {
  swirl::Mutex mu;
  std::deque<SoftCq*> events ABSL_GUARDED_BY(mu);
  // fd (in ibv_comp_channel) is an eventfd in semaphore mode: one count per queued event.
  void Notify(SoftCq* cq);
};

// The caller's array of a poll in progress (PollCq): a completion that the poll's own progress
// produces may go straight into it, skipping the CQ's ring (SoftCq::Push, SoftQp::poll_sink;
// receive completions of whole SENDs use it).
struct PollSink {
  SoftCq* cq;
  ibv_wc* wc;
  uint32_t capacity;
  uint32_t count;
};

// One completion with what the CQ needs to release send-queue slots when it is polled.
struct Cqe {
  ibv_wc wc;
  SoftQp* qp;           // for send completions: whose SQ slots to release
  uint32_t sq_release;  // release SQ slots up to this index (exclusive); valid if qp != nullptr
};

// An allocator whose resize() leaves trivial elements uninitialized: a CQ sized for every
// connection a worker may hold (millions of entries) then costs memory only for the entries
// completions have actually used, not for zeroing the whole ring at creation.
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using CqeRing = std::vector<Cqe, DefaultInitAllocator<Cqe>>;

// Every CQ is an ibv_cq_ex, whose first fields are those of ibv_cq (ibv_cq_ex_to_cq is a cast),
// so one object serves ibv_poll_cq and, for a CQ made by ibv_create_cq_ex, the extended polling
// functions it carries (cq_ex.cc). Convert with AsSoft(ibv_cq*) and SoftCq::ibv().
struct SoftCq : ibv_cq_ex {
  ibv_cq* ibv() { return ibv_cq_ex_to_cq(this); }

  SoftContext* sctx;
  SoftChannel* sc;  // channel, or nullptr
  // What a poll does before progress, as the fabric decided at creation (Fabric::poll_hook:
  // TCP reads what arrived on the HCA's links; null on shared memory).
  bool (*pull_links)(Hca*) = nullptr;

  SpinLock lock;
  CqeRing ring;  // capacity cqe (+1 spare slot to tell full from empty)
  uint32_t ring_mask = 0;  // ring.size() - 1
  uint32_t head = 0;      // next to poll (under lock)
  uint32_t tail = 0;      // next to fill (under lock)
  std::atomic<uint32_t> depth{0};  // tail - head, for a lock-free "anything there?" check
  std::atomic<bool> overflowed{false};  // written under lock; read without it by an empty poll

  std::atomic<int> armed{0};  // 0: no, 1: solicited only, 2: next completion
  std::atomic<int> attached{0};  // QPs completing into this CQ
  // HCA thread only, set by MarkAssistedCqs: the owner sleeps on it (armed) or has not polled
  // it for a while (stale). HcaAssists(qp) decides from these whose progress it makes.
  bool assist_armed = false;
  bool assist_stale = false;

  // Bumped by every poll_cq: the HCA thread reads it to tell whether the application is
  // polling this CQ (if not, the HCA thread makes progress for it). Own cache line: only the
  // polling thread writes it.
  alignas(64) std::atomic<uint64_t> polls{0};
  alignas(64) uint64_t last_polls_seen = 0;  // HCA thread only
  int64_t last_change_ns = 0;                // HCA thread only

  // QPs that complete into this CQ. A spin lock, not swirl::Mutex: every poll takes it, and
  // Debian's Abseil keeps deadlock detection on, which costs tens of ns per acquisition.
  SpinLock attach_lock;
  std::vector<SoftQp*> qps;  // guarded by attach_lock
  // QPs waiting to attach or detach: pollers leave attach_lock to them. A poller walks every
  // attached QP under that lock and polls again at once, so with thousands of QPs on one CQ
  // a QP being created spun behind a busy worker's polls for many milliseconds.
  std::atomic<int> attach_waiting{0};
  // QPs created since the last poll (AttachQp): the next poll that takes attach_lock moves them
  // into `qps`. Creating a QP then never waits for a poller's walk, nor for a poller that was
  // descheduled holding attach_lock (on a loaded machine that wait was milliseconds per
  // connection, growing with the QPs walked). Under pending_lock, held only to push or take.
  SpinLock pending_lock;
  std::vector<SoftQp*> pending_attach;
  std::atomic<bool> attach_pending{false};
  // With more attached QPs than a poll walks (kPollWalk), each poll takes the next kPollWalk of
  // them in turn, and every poll the QPs that had work lately (hot, most recent first): a
  // worker holding 10,000 connections then pays for those that are busy, not for reading
  // every idle peer's ring on every poll. Under attach_lock.
  // A poll after kIdleStreak that found nothing walks kPollWalkIdle instead: a worker with no
  // work spins on empty polls, and a frame that arrives on a quiet QP (a new call on one of
  // 10,000 connections) is then found within a few polls instead of 10,000 / 64 of them, while
  // a busy worker's polls stay short. A QP stays hot for kHotPolls polls after its last work
  // (a call's request went out: its response comes next), not only until one poll finds it
  // quiet, so the answer is found at once and not when the walk comes round to it again.
  static constexpr size_t kPollWalk = 64;
  static constexpr size_t kPollWalkIdle = 1024;
  static constexpr uint32_t kIdleStreak = 4;
  static constexpr uint64_t kHotPolls = 4096;
  static constexpr size_t kHot = 16;
  size_t walk_next = 0;
  uint32_t idle_streak = 0;
  uint64_t walk_serial = 0;     // polls that walked
  SoftQp* hot[kHot] = {};
  uint64_t hot_seen[kHot] = {};  // walk_serial of each hot QP's last work

  swirl::Mutex events_mu;
  swirl::CondVar events_cv;
  uint64_t events_delivered ABSL_GUARDED_BY(events_mu) = 0;
  uint64_t events_acked ABSL_GUARDED_BY(events_mu) = 0;

  // Adds a completion. Returns false on overflow (the CQ is then in error and stays so).
  // Inline: every message completes through it.
  bool Push(const ibv_wc& wc, SoftQp* qp, uint32_t sq_release, bool solicited) {
    return Push(qp, sq_release, solicited, wc.status, [&wc](ibv_wc& slot) { slot = wc; });
  }
  // The same, with the ibv_wc built in place: `fill(ibv_wc&)` sets the fields of a zeroed one
  // (its status must be `status`). With `direct`, the array of a poll of this CQ running the
  // progress that produced the completion, it goes straight into that array when nothing older
  // waits in the ring: every earlier completion of the same queue was pushed under the QP lock
  // the poller holds, so an empty ring means none of them is still queued. Such a completion
  // never occupies the ring, as a CQE polled the moment it is written would not.
  template <typename Fill>
  bool Push(SoftQp* qp, uint32_t sq_release, bool solicited, ibv_wc_status status, Fill&& fill,
            PollSink* direct = nullptr) {
    if (direct != nullptr && direct->cq == this && direct->count < direct->capacity &&
        depth.load(std::memory_order_relaxed) == 0 &&
        !overflowed.load(std::memory_order_relaxed)) {
      ibv_wc& wc = direct->wc[direct->count++];
      std::memset(&wc, 0, sizeof(wc));
      fill(wc);
      if (qp != nullptr) ReleaseSendSlots(qp, sq_release);
    } else {
      std::lock_guard<SpinLock> guard(lock);
      if (overflowed.load(std::memory_order_relaxed) || tail - head == static_cast<uint32_t>(cqe)) {
        return OverflowLocked();
      }
      Cqe& e = ring[tail & ring_mask];
      std::memset(&e.wc, 0, sizeof(e.wc));
      fill(e.wc);
      e.qp = qp;
      e.sq_release = sq_release;
      ++tail;
      depth.store(tail - head, std::memory_order_relaxed);
    }
    if (armed.load(std::memory_order_acquire) != 0) NotifyIfArmed(solicited, status);
    return true;
  }
  // A signaled send completion, once polled, frees its slot and those of the unsignaled ones
  // before it.
  static void ReleaseSendSlots(SoftQp* qp, uint32_t sq_release);

  // ibv_create_cq_ex's polling (cq_ex.cc): the completion start_poll/next_poll took last, which
  // the read_* functions read, and the lock held from start_poll to end_poll (a batch is one
  // poller's, as on real providers), unless the CQ was created single-threaded.
  ibv_wc ex_wc{};
  SpinLock ex_lock;
  bool ex_single_threaded = false;

 private:
  // The slow halves of Push: overflow (lock held) and a completion event for an armed CQ.
  bool OverflowLocked();
  void NotifyIfArmed(bool solicited, ibv_wc_status status);
};

inline SoftCq* AsSoft(ibv_cq* cq) {
  return static_cast<SoftCq*>(reinterpret_cast<ibv_cq_ex*>(cq));
}

// A receive queue: the QP's own, or an SRQ's.
struct RecvQueue {
  uint32_t capacity = 0;  // max_wr
  uint32_t max_sge = 0;
  uint32_t mask = 0;
  std::vector<uint64_t> wr_id;
  std::vector<uint32_t> num_sge;
  std::vector<ibv_sge> sge;  // capacity' * max_sge
  uint32_t head = 0;         // next to consume
  uint32_t tail = 0;         // next to post

  void Init(uint32_t cap, uint32_t sges);
  uint32_t size() const { return tail - head; }
};

struct SoftSrq : ibv_srq {
  SoftContext* sctx;
  SoftPd* spd;
  SpinLock lock;
  RecvQueue rq;
  std::atomic<int> qp_count{0};
  // The armed srq_limit (ibv_modify_srq with IBV_SRQ_LIMIT), under `lock`; 0: not armed.
  uint32_t limit = 0;

  // Under `lock`, after a receive was taken: true, once, if that left fewer than the armed
  // limit; the limit is then disarmed (ibv_query_srq reports 0) and the caller raises
  // IBV_EVENT_SRQ_LIMIT_REACHED with RaiseSrqLimitReached once it has released the lock.
  bool CrossedLimit() {
    if (limit == 0 || rq.size() >= limit) return false;
    limit = 0;
    return true;
  }
};

// ---- QP ---------------------------------------------------------------------------------------

struct SendWqe {
  uint64_t wr_id;
  ibv_wr_opcode opcode;
  unsigned int send_flags;
  enum State : uint8_t { kQueued, kAwaiting, kDone } state;
  bool inline_copy;  // the data lives in the QP's inline buffer for this slot
  bool has_msn;
  ibv_wc_status status;
  uint32_t msn;
  uint32_t length;    // message bytes
  uint32_t sent;      // bytes transmitted
  uint32_t received;  // READ bytes placed
  uint64_t remote_addr;
  uint32_t rkey;
  uint32_t imm_or_inv;
  uint64_t compare_add;
  uint64_t swap;
  uint32_t num_sge;
  // BIND_MW, captured when posted: the application may deallocate the window or deregister the
  // region before the bind runs, so the WQE holds their key slots (which live as long as the
  // table) and what those slots stood for, never the objects' pointers.
  KeyEntry* bind_mw_entry;
  uint32_t bind_mw_index;  // the window's slot index then (a reused slot answers to another)
  bool bind_mw_type2;
  const ibv_pd* bind_mw_pd;
  // Type 2, a bind into a fresh slot: the slot the window leaves (null: it stays), which must
  // hold no binding when the bind runs, and its generation then.
  KeyEntry* bind_from;
  uint64_t bind_from_generation;
  KeyEntry* bind_mr_entry;  // null: no region (a type 1 unbind)
  uint32_t bind_mr_lkey;
  uint64_t bind_addr;
  uint64_t bind_length;
  unsigned int bind_access;
  uint32_t bind_rkey;
};

// A peer's segment, validated and mapped read-only by the HCA thread.
struct PeerSegment {
  const char* base = nullptr;
  uint64_t size = 0;
  // Ring geometry, validated and copied out of the peer's header (which it could rewrite).
  uint64_t request_ring_offset = 0, request_ring_size = 0;
  uint64_t response_ring_offset = 0, response_ring_size = 0;
  uint64_t watch = 0;  // the HCA watch on the connection it came on (liveness)
  int wake_fd = -1;  // the peer HCA's wake eventfd (TCP fabric: none, -1)
  // Shared memory: the peer process (its pid, as the kernel reported it) whose HCA's wake
  // eventfd `wake_fd` is, shared by every QP linked to that HCA (Hca::SharePeerWake); 0: not
  // shared, `wake_fd` is this segment's own.
  pid_t wake_pid = 0;
  ibv_gid gid{};
  uint32_t qp_num = 0;
  // TCP fabric: `base` is a private mirror owned by the link's TcpLink, unmapped with it.
  bool mirror = false;
  // The link key serial (SoftQp::key_serial) the peer proved knowledge of; 0: keyless hello.
  // A QP adopts only a candidate proved with the key it has (or none, if it has none).
  uint64_t auth_serial = 0;
  const wire::SegmentControl* control() const {
    return reinterpret_cast<const wire::SegmentControl*>(base + wire::kControlOffset);
  }
  // Unmaps and closes; `hca` to drop the watch.
  void Close(Hca* hca);
};

// A QP's lock, and the hint that lets an idle poll skip the QP without taking it.
//
// A busy-polling application mostly polls QPs with nothing to do. The hint says that the last
// holder found the QP idle (ProgressLocked's quick return) and where the only news that could
// change that would appear: the stamp words of the next request and response frames, and the
// peer's link state (all in the peer's segment), besides the HCA thread's link_event and
// peer_gone. Whoever takes the lock may change the QP's state, so taking it withdraws the hint;
// the next poll that finds the QP idle under the lock publishes it again.
//
// A poller that reads the hint without the lock holds the attach lock of the CQ it polls, and
// the peer's segment is unmapped only after passing through the attach locks of both of the
// QP's CQs (TeardownLink), so the words the hint points at stay mapped while anyone reads them.
//
// A reader held up between loading a stamp pointer and loading through it can find the ring
// lapped: the word is then inside some later frame. Stamps are at kFrameAlign-aligned offsets,
// so that word is one as well, and whoever writes ring space that this process reads stores
// every such word atomically: on the TCP fabric, the HCA thread copying an arriving record into
// the mirror (ApplyFrame, tcp_link.cc). On shared memory the writer is the peer, through its own
// mapping of the segment (another process, or another address in this one): outside the C++
// memory model and ThreadSanitizer's view; a torn value there is just another wrong answer.
class QpLock {
 public:
  void lock() {
    lock_.lock();
    idle_.store(false, std::memory_order_relaxed);
  }
  bool try_lock() {
    if (!lock_.try_lock()) return false;
    idle_.store(false, std::memory_order_relaxed);
    return true;
  }
  void unlock() { lock_.unlock(); }

  // Holder only: the QP is idle until a frame arrives at one of these stamps or the peer's
  // link state changes.
  void PublishIdle(const uint64_t* req_stamp, uint64_t req_expect, const uint64_t* resp_stamp,
                   uint64_t resp_expect, const std::atomic<uint64_t>* peer_state) {
    req_stamp_.store(req_stamp, std::memory_order_relaxed);
    req_expect_.store(req_expect, std::memory_order_relaxed);
    resp_stamp_.store(resp_stamp, std::memory_order_relaxed);
    resp_expect_.store(resp_expect, std::memory_order_relaxed);
    peer_state_.store(peer_state, std::memory_order_relaxed);
    idle_.store(true, std::memory_order_release);
  }
  // Without the lock: true if the QP was idle and no frame or link change has arrived since.
  // A wrong answer is transient and only defers the QP: a "busy" QP is taken under the lock;
  // an "idle" one read as the hint is withdrawn is what a poll a moment earlier would have seen;
  // and a pointer and expected value from two holders' publications (the fields are separate
  // atomics) can miss a frame for one poll, until the next poll reads them settled.
  bool StillIdle() const {
    if (!idle_.load(std::memory_order_acquire)) return false;
    const uint64_t* req = req_stamp_.load(std::memory_order_relaxed);
    const uint64_t* resp = resp_stamp_.load(std::memory_order_relaxed);
    if (__atomic_load_n(req, __ATOMIC_RELAXED) == req_expect_.load(std::memory_order_relaxed)) {
      // A request is there: its second line comes over with its first (RingReader::Ready).
      __builtin_prefetch(reinterpret_cast<const char*>(req) + wire::kCacheLine);
      return false;
    }
    return __atomic_load_n(resp, __ATOMIC_RELAXED) !=
               resp_expect_.load(std::memory_order_relaxed) &&
           peer_state_.load(std::memory_order_relaxed)->load(std::memory_order_relaxed) ==
               wire::kLinkActive;
  }

  // Starts loading the words StillIdle reads in the peer's segment (this QP's line has to be
  // in already, or be on its way: its pointers are read here). For walks, a few QPs ahead.
  void PrefetchWatched() const {
    if (!idle_.load(std::memory_order_relaxed)) return;
    __builtin_prefetch(req_stamp_.load(std::memory_order_relaxed));
    __builtin_prefetch(resp_stamp_.load(std::memory_order_relaxed));
    __builtin_prefetch(peer_state_.load(std::memory_order_relaxed));
  }

 private:
  SpinLock lock_;
  std::atomic<bool> idle_{false};
  std::atomic<const uint64_t*> req_stamp_{nullptr};
  std::atomic<uint64_t> req_expect_{0};
  std::atomic<const uint64_t*> resp_stamp_{nullptr};
  std::atomic<uint64_t> resp_expect_{0};
  std::atomic<const std::atomic<uint64_t>*> peer_state_{nullptr};
};

// libibverbs' struct verbs_qp (driver.h, which is not installed): the QP is an ibv_qp and, over
// the same bytes, an ibv_qp_ex (whose first member is that ibv_qp), followed by comp_mask and
// xrcd. libibverbs' own ibv_qp_to_qp_ex reads comp_mask at that offset and, with VERBS_QP_EX
// set, hands the application the ibv_qp_ex. The soft objects derive from their libibverbs
// structure, so this one derives from ibv_qp and keeps the rest of ibv_qp_ex as storage that
// qp_ex() overlays.
struct VerbsQp : ibv_qp {
  // verbs_qp's comp_mask bits (driver.h).
  static constexpr uint32_t kVerbsQpEx = 1 << 1;

  ibv_qp_ex* qp_ex() { return reinterpret_cast<ibv_qp_ex*>(static_cast<ibv_qp*>(this)); }

  alignas(ibv_qp_ex) unsigned char qp_ex_rest[sizeof(ibv_qp_ex) - sizeof(ibv_qp)] = {};
  uint32_t comp_mask = 0;
  void* xrcd = nullptr;
};
// The overlay holds if ibv_qp_ex is an ibv_qp followed directly by its own fields, and nothing
// pads the storage away from the ibv_qp base (its size is a multiple of the alignment).
static_assert(offsetof(ibv_qp_ex, qp_base) == 0);
static_assert(offsetof(ibv_qp_ex, comp_mask) == sizeof(ibv_qp));
static_assert(sizeof(ibv_qp) % alignof(ibv_qp_ex) == 0);

// The ibv_wr_* batch of a QP made by ibv_create_qp_ex with IBV_QP_INIT_ATTR_SEND_OPS_FLAGS
// (qp_ex.cc): the requests built between wr_start and wr_complete, as an ibv_send_wr chain in
// storage sized at creation (one slot per send-queue entry), posted by PostSendAll.
struct WrBatch {
  uint64_t send_ops = 0;       // IBV_QP_EX_WITH_* the QP was created for
  uint32_t sge_slots = 1;      // ibv_sge per request: max_send_sge, at least one for inline data
  uint32_t max_inline = 0;     // inline bytes per request (max_inline_data)
  std::vector<ibv_send_wr> wrs;
  std::vector<ibv_sge> sges;
  std::unique_ptr<char[]> inline_data;  // max_inline per request: what the inline setters copy
  // Everything below is the critical section's: wr_start takes `mu`, wr_complete and wr_abort
  // release it (ibv_wr_post(3): no other thread enters between them).
  swirl::Mutex mu;
  uint32_t count = 0;
  int error = 0;             // the first error a builder or setter met; wr_complete returns it
  bool takes_data = false;   // the newest request accepts the SGE and inline-data setters
};

struct SoftQp : VerbsQp {
  SoftContext* sctx;
  Hca* hca;
  Fabric* fabric;  // hca's (a copy: every publish calls it)
  SoftPd* spd;
  uint64_t serial = 0;  // unique in the process for its lifetime (type 2 window bindings)
  size_t hca_index = 0;  // in hca->qp_list (under hca->mu)
  SoftCq* scq;
  SoftCq* rcq;
  SoftSrq* ssrq;

  // A poll's idle check (IdleWithoutLock) reads this line and nothing else of the QP: the lock,
  // its idle hint, and the HCA thread's news for the QP, which it sets without the lock. A walk
  // over thousands of attached QPs costs a cache miss per QP for this line (cq.cc prefetches).
  alignas(64) QpLock lock;  // everything below except where noted
  std::atomic<bool> link_event{false};
  std::atomic<bool> peer_gone{false};

  // Configuration.
  uint32_t max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline;
  bool sig_all;

  // State and attributes (for query_qp).
  ibv_qp_state qstate = IBV_QPS_RESET;
  ibv_qp_attr attr{};

  // Send queue: slots [released, tail) are in use; [head, tx) transmitted but not completed.
  // Not zeroed at creation (DefaultInitAllocator): a post writes what its slot's readers use
  // (FillWqe clears the slot, the fast send sets every field a SEND reads), as it must once the
  // ring wraps and slots hold an older request's leftovers. Zeroed, a worker's 128 slots of
  // 160 bytes were 20 KiB of touched memory per QP, an idle connection's largest cost.
  std::vector<SendWqe, DefaultInitAllocator<SendWqe>> sq;
  std::vector<ibv_sge, DefaultInitAllocator<ibv_sge>> sq_sge;
  // Not zeroed at creation (DefaultInitAllocator): max_inline_data per slot was 128 KiB of
  // touched memory per QP of a worker, used or not; now a slot costs memory once written.
  std::vector<char, DefaultInitAllocator<char>> sq_inline;
  uint32_t sq_mask = 0;
  uint32_t sq_head = 0, sq_tx = 0, sq_tail = 0;
  // Index of the newest signaled WQE posted (sq_head - 1 or older: none outstanding). A
  // requester that owes a completion must look for acks even when no frame brings one.
  uint32_t newest_signaled = ~0u;
  // A request failed behind others in the send queue: its error completion is owed even if it
  // was unsignaled, so a completion is wanted until the QP enters the error state.
  bool failure_pending = false;
  // A request at or before sq_tx failed (locally, or NAKed): nothing behind it is transmitted.
  // It completes in order with its error, and the QP then enters the error state and flushes
  // the rest, as a real requester stops at its first error (rxe_requester goes to `err`).
  bool sq_stopped = false;
  std::atomic<uint32_t> sq_released{0};  // written by the CQ poller
  uint32_t next_msn = 0;
  // Polls in a row that found requests outstanding and nothing moving (ProgressNormal): past a
  // threshold the peer's HCA thread is kicked (KickPeerHca).
  uint32_t stalled_polls = 0;
  // RC's transport timer (RunTransportTimer), on every QP: since when the oldest outstanding
  // request has waited with nothing from the peer moving for it (0: not waiting), and what had
  // moved when that was last looked at.
  struct {
    int64_t waiting_since_ns = 0;
    uint32_t seen_sq_head = 0;
    uint32_t seen_peer_acked = 0;
    uint64_t seen_resp_tail = 0;
    uint64_t seen_req_consumed = 0;
  } timer;
  uint32_t rd_atomic_outstanding = 0;
  uint32_t peer_acked = 0;  // latest `acked` seen from the peer (next MSN it expects)

  RecvQueue rq;  // unused with an SRQ

  // Responder.
  uint32_t expected_msn = 0;
  uint32_t acked_published = 0;
  uint64_t req_consumed_published = 0;
  uint64_t resp_consumed_published = 0;
  bool discard_requests = false;  // the requester is failing: consume without executing
  bool write_in_progress = false;  // between the first and last chunk of an RDMA WRITE
  // That WRITE's announced total and bytes placed so far: a peer's chunks must add up to the
  // total it announced (WRITE_WITH_IMM reports the total as byte_len).
  uint32_t write_total = 0;
  uint32_t write_placed = 0;
  struct {
    bool active = false;
    uint32_t msn = 0;
    uint64_t wr_id = 0;
    uint32_t num_sge = 0;
    ibv_sge sge[kMaxSge];
    uint32_t capacity = 0;
    uint32_t offset = 0;
    uint32_t total = 0;
  } cur_recv;
  struct {
    bool active = false;
    uint32_t msn = 0;
    uint64_t addr = 0;
    uint32_t rkey = 0;
    uint32_t length = 0;
    uint32_t offset = 0;
  } cur_read;
  bool rnr_waiting = false;
  int64_t rnr_deadline_ns = 0;  // 0: wait forever
  struct {
    bool active = false;
    uint32_t msn = 0;
    uint32_t status = 0;
  } pending_nak;  // a NAK that did not fit in the response ring yet
  bool cq_overflow = false;   // a CQ we complete into overflowed: fail at the next chance
  // Set by a poller only while it holds `lock` and runs this QP's progress (cq.cc).
  PollSink* poll_sink = nullptr;
  bool entering_error = false;

  // Link: our segment and the peer's. Shared memory closes `memfd` once the link is adopted
  // (the peer has it, or never will: ShmFabric::LinkAdopted); TCP keeps it.
  int memfd = -1;
  // Our segment's control block, for the HCA thread's sleeping flag (read under hca->mu).
  std::atomic<wire::SegmentControl*> ctrl_for_hca{nullptr};
  char* own_base = nullptr;
  uint64_t own_size = 0;
  wire::SegmentControl* own_ctrl = nullptr;
  RingWriter req_tx, resp_tx;
  int out_socket = -1;
  uint64_t out_watch = 0;
  PeerSegment peer;
  uint64_t in_watch = 0;
  RingReader req_rx, resp_rx;
  bool linked = false;
  int64_t link_deadline_ns = 0;  // RETRY_EXC if not linked by then with work outstanding
  int64_t next_link_attempt_ns = 0;  // TCP, connecting side: when to open a closed link again

  // (link_event and peer_gone, which the HCA thread sets, are beside `lock`, above.)
  // TCP fabric: control words changed and are not shipped yet (PullTcp ships them).
  std::atomic<bool> tcp_control_due{false};
  swirl::Mutex incoming_mu;
  std::vector<PeerSegment> incoming ABSL_GUARDED_BY(incoming_mu);
  // Shared memory: the QP reached RTR while its peer's keyed hello was still in its handshake,
  // and sends its reply (its segment) when that hello is offered (OfferSegment, HCA thread),
  // whatever its owner is doing; `replied_watch`: the connection the reply went on. (memfd is
  // closed, and these cleared, under incoming_mu: the HCA thread reads them under it.)
  bool want_reply = false;
  uint64_t replied_watch = 0;

  // ibv_qp_ex's work-request builders (null unless created for them; qp_ex.cc).
  std::unique_ptr<WrBatch> wr_batch;

  // The link key (SetLinkKey), which the HCA thread reads to answer a peer's hello
  // (QpKeyFor). Not under `lock`: the HCA thread never takes a QP's lock.
  swirl::Mutex key_mu;
  LinkKey link_key ABSL_GUARDED_BY(key_mu) = {};
  uint64_t key_serial ABSL_GUARDED_BY(key_mu) = 0;  // 0: no key; unique per SetLinkKey call
  // Past INIT (RTR or later): the key can no longer change, so a QP without one refuses keyed
  // hellos instead of keeping them waiting for a key.
  bool key_final ABSL_GUARDED_BY(key_mu) = false;
  // Injected faults and the transport timer (faults.cc): null unless the process has faults
  // armed; then this QP takes the general paths (Normal() is false), where they act. Set once,
  // with release; owned by the QP; its fields are the QP lock's.
  std::atomic<QpFaults*> faults{nullptr};
};
// The walk's idle check reads one line of the QP: the lock (aligned) and the two flags after it.
static_assert(sizeof(QpLock) + 2 * sizeof(std::atomic<bool>) <= 64);

// A QP's injected fault and transport timer (soft_device.h, "Injected faults"; faults.cc). Its
// rings call it for each frame they write (CommitHook) while a fault is armed.
struct QpFaults final : CommitHook {
  explicit QpFaults(SoftQp* q) : qp(q) {}
  bool BeforeStamp(RingWriter& ring, char* frame, uint64_t pos) override;

  SoftQp* const qp;
  // The armed fault, if any (`armed`), and how far it has got.
  bool armed = false;
  FaultSpec spec;
  uint32_t frames_out = 0;  // frames written since it was armed
  bool fired = false;
  bool pending = false;     // fired, and its action is the QP's next progress's (fail, err)
  // Stall and drop: nothing moves until `frozen_until_ns` (drop: never).
  bool frozen = false;
  int64_t frozen_until_ns = 0;
  bool silent = false;      // noack: the responder takes nothing more
  // The first frame written while frozen (or the one a fault fired at), its stamp held back:
  // the peer reads a ring in order, so nothing after it shows either.
  RingWriter* held_ring = nullptr;
  char* held_frame = nullptr;
  uint64_t held_pos = 0;
  // Drop: the control block the QP publishes into from then on, which the peer never sees.
  alignas(wire::kCacheLine) wire::SegmentControl blackhole{};
};

// A poll's check before taking a QP's lock (cq.cc): the QP is idle (QpLock) and the HCA thread
// has no news for it either.
inline bool IdleWithoutLock(const SoftQp* qp) {
  return qp->lock.StillIdle() && !qp->link_event.load(std::memory_order_relaxed) &&
         !qp->peer_gone.load(std::memory_order_relaxed);
}

// Calls fn(at(k)) for k in [0, count), loading ahead what each IdleWithoutLock reads: the QP's
// line kLineAhead QPs on, the words it watches in the peer's segment kWatchAhead on (that
// needs the QP's line, prefetched earlier). With thousands of QPs each is a likely cache miss,
// and taken one after another an idle walk over 1,024 QPs cost about 200 us.
template <typename At, typename Fn>
inline void WalkPrefetched(size_t count, At at, Fn fn) {
  constexpr size_t kLineAhead = 8, kWatchAhead = 4;
  for (size_t k = 0; k < std::min(kLineAhead, count); ++k) __builtin_prefetch(&at(k)->lock);
  for (size_t k = 0; k < std::min(kWatchAhead, count); ++k) at(k)->lock.PrefetchWatched();
  for (size_t k = 0; k < count; ++k) {
    if (k + kLineAhead < count) __builtin_prefetch(&at(k + kLineAhead)->lock);
    if (k + kWatchAhead < count) at(k + kWatchAhead)->lock.PrefetchWatched();
    fn(at(k));
  }
}

// ---- HCA: one per device name per process ----------------------------------------------------

struct TcpLink;  // tcp_link.cc

// A keyed link's handshake in progress (link_auth.h; docs/SOFT_WIRE.md, "Link keys"), on
// either fabric. The opener waits for the challenge; the accepter waits for its QP's key (the
// hello came before SetLinkKey: parked), then for the proof.
struct LinkAuth {
  enum Phase : uint8_t { kAwaitChallenge, kAwaitKey, kAwaitProof, kDone };
  Phase phase = kAwaitChallenge;
  LinkKey key{};
  uint64_t key_serial = 0;
  Nonce nonce{};                // the accepter's (its challenge's)
  std::vector<uint8_t> hello;   // the opener's hello as it travelled: what the MACs cover
  ibv_gid accepter_gid{};
  uint32_t accepter_flags = 0;
  int memfd = -1;               // shared memory, opener: our segment until the proof carries it
  int64_t deadline_ns = 0;      // accepter: when a parked hello or a missing proof is given up
  // Shared memory, accepter: counted in toward_hca->handshakes_toward[toward_qpn] while it
  // lives (Hca::CountHandshakeToward), so that QP replies on this connection instead of
  // opening its own.
  Hca* toward_hca = nullptr;
  uint32_t toward_qpn = 0;
  LinkAuth() = default;
  LinkAuth(const LinkAuth&) = delete;
  LinkAuth& operator=(const LinkAuth&) = delete;
  ~LinkAuth();
};

struct LinkWatch {
  SoftQp* qp = nullptr;  // null while the connection still owes its hello
  int fd = -1;
  TcpLink* tcp = nullptr;  // TCP fabric only: the link's state (owned; see DestroyTcpLink)
  // The QP took this link as its own (its outgoing link, or the peer segment it adopted). Only
  // then does the link's end fail the QP: a candidate that dies, or that a stranger sent, must
  // not take down the link the QP really has. `dead` remembers an end seen before adoption.
  bool adopted = false;
  bool dead = false;
  // Shared memory: the keyed handshake in progress on this connection (null: none, or done).
  std::unique_ptr<LinkAuth> auth;
  // Shared memory: the process at the other end (SO_PEERCRED; 0 if the kernel could not name
  // it), which keys the wake eventfd its hellos carry.
  pid_t peer_pid = 0;
  // Shared memory, the connection a QP opened with its hello: the peer may answer on it with
  // its own segment (a reply hello) once, instead of opening a connection of its own.
  bool reply_allowed = false;
  uint64_t hello_serial = 0;  // the link key serial our hello was proved with (0: keyless)
};

// Ends watch `id`'s connection both ways (shutdown(2)) as a failed link would: each end's HCA
// then sees the hang-up and fails the QP that adopted it. Takes watch_mu.
void ShutdownWatch(Hca* hca, uint64_t id);
// Calls fn(qp) for every QP of every soft device of this process, under the device registry's
// lock and each device's mu (not the QP's lock): a QP it names is not destroyed meanwhile.
void ForEachQp(const std::function<void(SoftQp*)>& fn);

// Marks watch `id` adopted by its QP, unless its connection has already ended: then returns
// false and the candidate should be dropped. Takes watch_mu.
bool AdoptWatch(Hca* hca, uint64_t id);
// Whether watch `id` is gone or its connection ended (0: no watch is dead too).
bool WatchDead(Hca* hca, uint64_t id);
// The connection of watch `watch` ended: fails its QP if adopted, remembers it otherwise.
// Caller holds watch_mu.
void WatchEnded(LinkWatch& watch);

struct Hca {
  std::string name;
  ibv_gid gid{};
  uint64_t guid = 0;
  KeyTable keys;
  int refs = 0;  // contexts open on it (registry mutex)

  int listen_fd = -1;
  int wake_fd = -1;  // eventfd: peers write it when we sleep
  // How QPs reach their peers (fabric.h), chosen when the device opens: shared memory, or TCP
  // (SWIRL_SOFT_TCP), whose state follows (tcp_link.cc only).
  std::unique_ptr<Fabric> fabric;
  uint32_t tcp_addr = 0;  // IPv4, network order
  // Keyed links' records are sealed (AES-256-GCM) unless SWIRL_SOFT_TCP_CRYPT=off; a link is
  // sealed if either side asks.
  bool tcp_crypt = true;
  // The incoming links polls read (PullTcp): one epoll_wait per poll, however many links; with
  // a single one, a poll reads it without asking epoll (one syscall per message, not two).
  int tcp_poll_fd = -1;
  std::vector<uint64_t> tcp_incoming ABSL_GUARDED_BY(watch_mu);
  // Some QP has control words to ship (its tcp_control_due), so PullTcp looks for it.
  std::atomic<bool> tcp_control_due{false};
  int epoll_fd = -1;
  int stop_fd = -1;
  std::thread thread;
  // Passes of that thread's loop, for an application thread that needs it to have looked at
  // what is already on its sockets (WaitForHcaPasses); while anyone waits, the loop neither
  // sleeps nor spins between passes.
  swirl::Mutex pass_mu;
  swirl::CondVar pass_cv;
  uint64_t passes ABSL_GUARDED_BY(pass_mu) = 0;
  std::atomic<int> pass_waiters{0};
  bool assist = true;  // make progress for CQs nobody polls

  // Serializes memory-window state changes: binds and local invalidations (SQ processing of any
  // QP), remote invalidations (responders) and dealloc (application threads).
  swirl::Mutex mw_mu;

  swirl::Mutex mu;
  absl::flat_hash_map<uint32_t, SoftQp*> qps ABSL_GUARDED_BY(mu);
  // The same QPs in an array (SoftQp::hca_index is each one's place), for the HCA thread's
  // passes over all of them (hca.cc), which prefetch ahead as a CQ's walk does.
  std::vector<SoftQp*> qp_list ABSL_GUARDED_BY(mu);
  std::vector<SoftCq*> cqs ABSL_GUARDED_BY(mu);
  // Acquired after mu when both are needed; never while calling into a QP.
  swirl::Mutex watch_mu;
  absl::flat_hash_map<uint64_t, LinkWatch> watches ABSL_GUARDED_BY(watch_mu);
  uint64_t next_watch ABSL_GUARDED_BY(watch_mu) = 1;
  absl::BitGen bitgen ABSL_GUARDED_BY(mu);
  // Every log line a peer can cause goes through this: a stranger sending bad hellos must not
  // fill the log.
  swirl::LogLimiter peer_log;
  // A QP got a link key or moved to RTR: keyed hellos waiting for it resume (ResumeParked*).
  std::atomic<bool> keys_changed{false};
  // Some peer's keyed handshake may be in progress here (set when one starts, cleared by a
  // ResumeParked* that finds none): only then does the HCA thread look for them, so a device
  // whose links have no keys pays nothing for them.
  std::atomic<bool> handshakes_pending{false};
  // TCP: connections closed, or refused, to keep one address within its share of the places
  // before authentication (TakeFromSource; tests read it).
  std::atomic<uint64_t> tcp_turned_away{0};

  // Peers' wake eventfds, one per peer HCA, whatever the number of QPs linked to it: each
  // hello carries a copy, and 10,000 QPs to one peer process would otherwise hold 10,000
  // descriptors of one eventfd. Keyed by the peer's pid as the kernel reports it (SO_PEERCRED:
  // a process cannot claim another's) and the GID its hello names (random per HCA, so a pid
  // reused by a later process, or a device reopened, is a new key).
  struct PeerWake {
    int fd = -1;
    int refs = 0;
  };
  // Keyed hellos toward each of our QPs whose handshake is under way here (LinkAuth).
  swirl::Mutex toward_mu;
  absl::flat_hash_map<uint32_t, int> handshakes_toward ABSL_GUARDED_BY(toward_mu);
  void CountHandshakeToward(uint32_t qpn, int delta);
  bool HandshakeToward(uint32_t qpn);
  swirl::Mutex peer_wake_mu;
  absl::flat_hash_map<std::pair<pid_t, std::string>, PeerWake> peer_wakes
      ABSL_GUARDED_BY(peer_wake_mu);
  // Takes `received` (a validated eventfd from peer `pid`'s HCA `gid`) and returns the
  // descriptor to wake that HCA with: the one already held for it (closing `received`), or
  // `received`. pid 0 (a process the kernel cannot name to us) is never shared.
  int SharePeerWake(pid_t pid, const ibv_gid& gid, int received);
  // Gives back a descriptor SharePeerWake returned; the last user closes it.
  void ReleasePeerWake(pid_t pid, const ibv_gid& gid, int fd);

  // Registers `fd` with the HCA thread for hangup detection; returns the watch id.
  // (`qp` non-null: the QP's own outgoing link, adopted from the start; `auth`: its keyed
  // handshake, which the HCA thread finishes; `peer_pid`: the process at the other end.)
  // `reply_serial`: shared memory, the QP's own hello with that key serial (0: keyless), on
  // which the peer may reply (set before the HCA thread can see the connection's first byte).
  uint64_t Watch(int fd, SoftQp* qp, std::unique_ptr<LinkAuth> auth = nullptr,
                 pid_t peer_pid = 0, std::optional<uint64_t> reply_serial = std::nullopt);
  // The same for a TCP link (takes ownership of `link`), with the epoll events it starts with.
  uint64_t WatchTcp(int fd, SoftQp* qp, TcpLink* link, uint32_t events);
  // Stops watching and closes the fd.
  void Unwatch(uint64_t id);
  void UnwatchLocked(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(watch_mu);
  // Wakes the HCA thread (an application armed a CQ).
  void Kick();
};

// Asynchronous events. async_fd is an eventfd used level-triggered: it holds 1 exactly while
// the queue is not empty (`signalled`), so poll() on it says whether an event waits, and the
// device reads it only when it knows it holds 1 (under mu), never waiting whatever the fd's
// O_NONBLOCK flag, which thereby belongs to the application (libibverbs' ibv_get_async_event
// blocks by default; swirl's DeviceOps opens it non-blocking and polls).
struct AsyncEvents {
  swirl::Mutex mu;
  std::deque<ibv_async_event> queue ABSL_GUARDED_BY(mu);
  bool signalled ABSL_GUARDED_BY(mu) = false;
  // Events handed out (TakeAsyncEvent) per object they name, until the object's destroy takes
  // the count (EndAsyncEvents): what the kernel reports to libibverbs' destroy as
  // events_reported. Counted in the same step as the event leaves the queue, so a destroy sees
  // every event handed out before it, and an object made later at the same address starts at 0.
  absl::flat_hash_map<const void*, uint32_t> delivered ABSL_GUARDED_BY(mu);
};

// The context. verbs_context must be first so ibv_context* maps back to it.
struct SoftContext {
  verbs_context vctx;
  Hca* hca = nullptr;
  ibv_device* device = nullptr;
  AsyncEvents async;

  void RaiseAsyncEvent(const ibv_async_event& event);
  // The oldest queued event, or EAGAIN if there is none. Never blocks.
  int TakeAsyncEvent(ibv_async_event* event);
  // An event affiliated with `qp`.
  void RaiseQpEvent(ibv_event_type type, ibv_qp* qp);
  // For `object` (a QP, CQ or SRQ being destroyed), as the kernel's destroy does: drops its
  // events not handed out yet (the application could not use their pointers) and returns how
  // many were handed out, which the destroy then waits to see acknowledged (WaitForAsyncAcks).
  uint32_t EndAsyncEvents(const void* object);

 private:
  // Clears async_fd once the queue is empty.
  void UnsignalIfEmptyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(async.mu);
};

// Waits, as libibverbs' destroys do, until `*completed` (the object's public count of
// acknowledged events, which AckAsyncEvent raises under `mutex` and signals on `cond`) reaches
// `delivered`: ibv_ack_async_event locks the object's mutex, which the destroy frees. Bounded
// (kAsyncAckWait), where libibverbs would wait forever for an application that never
// acknowledges: false then (logged), and the caller must not free the object (its mutex, its
// address) but leak it, or a late acknowledgement would write freed memory.
[[nodiscard]] bool WaitForAsyncAcks(pthread_mutex_t* mutex, pthread_cond_t* cond,
                                    const uint32_t* completed, uint32_t delivered,
                                    const char* what);
// Acknowledges `event` on its object (ibv_ack_async_event's bookkeeping; device.cc's
// AckAsyncEvent for both the embedded device and the interposer).
void CountAsyncAck(const ibv_async_event& event);

inline SoftContext* ToSoft(ibv_context* ctx) {
  verbs_context* vctx = reinterpret_cast<verbs_context*>(reinterpret_cast<char*>(ctx) -
                                                         offsetof(verbs_context, context));
  return reinterpret_cast<SoftContext*>(vctx);
}

// Whether the HCA thread makes progress for `qp` (HCA thread only): when its owner sleeps on
// one of its CQs (armed), or polls neither (both stale: a passive target). A QP whose owner
// polls one CQ is progressed by that poll, whatever the other CQ (ib_write_bw's client never
// polls its receive CQ): the HCA thread would only contend with the owner for the QP.
inline bool HcaAssists(const SoftQp* qp) {
  return qp->scq->assist_armed || qp->rcq->assist_armed ||
         (qp->scq->assist_stale && qp->rcq->assist_stale);
}

// ---- Functions shared between the files -------------------------------------------------------

// device.cc: whether `context` is a soft device's (the soft_device.h extensions check it).
bool IsSoftContext(const ibv_context* context);

int64_t NowNs();

// hca.cc
// ibv_query_pkey: the one P_Key there is, the default (full-membership) 0xffff at index 0 of
// port 1, in network order.
int QueryPkey(uint8_t port_num, int index, __be16* pkey);
Hca* AcquireHca(const std::string& name, std::string* error);
void ReleaseHca(Hca* hca);
std::string GidHex(const ibv_gid& gid);
// Connects to the HCA owning `gid`, handing it our segment for QP `dst_qpn` (keyless), or
// opening a keyed handshake (`key` non-null: the HCA thread finishes it, ReceiveChallenge).
// Refuses a listener of a user we do not trust (SO_PEERCRED). On success returns the
// connected socket, the listener's pid in *peer_pid and, for a keyed hello, the handshake's
// state in *auth; else -errno.
int SendHello(Hca* hca, const ibv_gid& gid, uint32_t src_qpn, uint32_t dst_qpn, int memfd,
              uint64_t segment_size, const LinkKey* key, uint64_t key_serial,
              std::unique_ptr<LinkAuth>* auth, pid_t* peer_pid);
// What QP `qpn` answers a keyed or keyless hello with (HCA thread; caller holds hca->mu as a
// reader): kNoQp; kKeyed (with its key and serial); kWait (no key yet and still before RTR:
// the hello waits for SetLinkKey); kKeyless (no key, and none can come).
enum class QpKeyState { kNoQp, kKeyed, kWait, kKeyless };
QpKeyState QpKeyFor(Hca* hca, uint32_t qpn, LinkKey* key, uint64_t* serial);
// Whether a peer process of user `uid` may link to us, or we to it: our own uid, or one
// listed in SWIRL_SOFT_TRUSTED_UIDS (comma-separated).
bool UidTrusted(uid_t uid);
// Keyed handshakes waiting for their QP's key resume (HCA thread, after SetLinkKey or RTR
// kicked it, and every loop): shared memory here, TCP in ResumeParkedTcp.
void ResumeParkedShm(Hca* hca);
// True if a peer's segment geometry (untrusted) is one we can map and read safely.
bool SegmentGeometryOk(uint64_t segment_size, uint64_t request_ring_offset,
                       uint64_t request_ring_size, uint64_t response_ring_offset,
                       uint64_t response_ring_size);
// Hands a validated peer segment to QP `dst_qpn` as a link candidate. Caller holds hca->mu
// (reader) and hca->watch_mu; on failure `segment` is left for the caller to close.
bool OfferSegment(Hca* hca, uint64_t watch_id, uint32_t dst_qpn, const PeerSegment& segment,
                  std::string* why);

// tcp_link.cc: the TCP fabric. Each QP's segment is replicated frame by frame over a TCP
// connection into a private mirror at the peer, so the QP code above reads the same layout.
// Parses SWIRL_SOFT_TCP ("IPv4" or "IPv4:port"; port 0 or none: any free port).
bool ParseTcpFabric(const char* spec, uint32_t* addr, uint16_t* port, std::string* why);
// Listens on addr:port; the GID that names it (port in bytes 8-9, ::ffff:IPv4 in 10-15).
int ListenTcp(uint32_t addr, uint16_t port, ibv_gid* gid, std::string* why);
// Whether the QP (own_gid, own_qpn) opens the connection to its peer at RTR. One side of a
// pair does (the smaller GID, then QPN); the other answers on that connection once it has
// adopted it (ReplyOnTcpLink), so one connection carries both directions.
bool TcpConnectsFirst(const ibv_gid& own_gid, uint32_t own_qpn, const ibv_gid& peer_gid,
                      uint32_t peer_qpn);
// Opens the connection to `gid`'s QP `dst_qpn` that ships `qp`'s segment (`memfd`) and receives
// its peer's; returns its watch id, or 0 if the GID names no TCP peer or the socket could not be
// set up (then nothing fails now: an unlinked QP fails at its link deadline, as on shared
// memory). Never blocks: the HCA thread completes the connect.
// With `key` (our QP's link key, of serial `key_serial`), the link opens with the keyed
// handshake and, unless SWIRL_SOFT_TCP_CRYPT=off on both sides, its records are sealed.
uint64_t ConnectTcpLink(Hca* hca, SoftQp* qp, const ibv_gid& gid, uint32_t dst_qpn, int memfd,
                        uint64_t segment_size, const LinkKey* key, uint64_t key_serial);
// `qp` adopted the peer segment that arrived on connection `watch_id`: ships its own segment
// back on it from now on. Returns `watch_id`, or 0 if that connection is gone or already
// carries a segment of ours (a connection we opened).
uint64_t ReplyOnTcpLink(Hca* hca, SoftQp* qp, uint64_t watch_id, int memfd,
                        uint64_t segment_size);
enum class AcceptResult {
  kDone,            // the backlog is empty
  kBusy,            // TCP: 64 connections owe their hello; the rest wait in the backlog
  kOutOfResources,  // the process or system ran out of descriptors or memory
};
// Accepts connections (at most 64 may owe their hello, 8 from one address, a silent one for
// 250 ms).
// Whether a new connection from `source` may take a place before authentication (making room
// if it can: TCP's per-address share). HCA thread; takes hca->mu and watch_mu itself.
bool TakeFromSource(Hca* hca, uint32_t source);
AcceptResult AcceptTcp(Hca* hca);
// Drops connections that owe their hello past its deadline, and fails QPs whose link did not
// connect in time (HCA thread).
void ExpireTcpLinks(Hca* hca, int64_t now);
// Keyed hellos waiting for their QP's key, and proofs overdue (HCA thread; takes hca->mu).
void ResumeParkedTcp(Hca* hca);
// An event on a TCP link's socket (HCA thread).
void HandleTcpEvent(Hca* hca, uint64_t id, uint32_t events);
// Ships whatever our QPs have written since the last call (HCA thread).
void ShipTcp(Hca* hca);
// The HCA thread reads a link only while its QP's CQs are assisted (nobody polls them, or the
// owner sleeps on a channel); otherwise polls read it (PullTcp) and a wakeup per message here
// would only take the core from them. Caller holds hca->mu (reader).
void WatchTcpReceives(Hca* hca);
// The same for one QP, from the thread that just published (its lock held): TCP links move
// with the application's own calls, as shared memory does, not at the HCA thread's wakeups.
void ShipTcpFor(SoftQp* qp);
// A poll's share: reads what has arrived on the HCA's links into their mirrors, unless another
// thread is doing so. Returns true if anything arrived.
bool PullTcp(Hca* hca);
// At RTS: a link whose peer stops acknowledging (a host that died without closing) fails
// after `timeout_ns`, as an RC requester's retries would (TCP_USER_TIMEOUT and keepalive).
void SetTcpLinkTimeout(Hca* hca, uint64_t watch, int64_t timeout_ns);
// Final best-effort ship, then frees watch `id`'s link (caller holds watch_mu; closes the fd
// and erases the watch itself).
void DestroyTcpLink(Hca* hca, uint64_t id, LinkWatch& watch);

// qp.cc
int CreateQp(SoftContext* sctx, ibv_pd* pd, ibv_qp_init_attr* attr, ibv_qp** out);
int ModifyQp(ibv_qp* qp, ibv_qp_attr* attr, int mask);
int QueryQp(ibv_qp* qp, ibv_qp_attr* attr, int mask, ibv_qp_init_attr* init);
int DestroyQp(ibv_qp* qp);
int PostSend(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr);
// ibv_wr_complete's post: the chain at `wr`, all or nothing. Every request is validated as
// ibv_post_send validates it, and the send queue must have room for all of them, before the
// first is queued; on an error (which it returns) nothing is posted.
int PostSendAll(SoftQp* qp, ibv_send_wr* wr);
int PostRecv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr);
int PostSrqRecv(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad_wr);
int BindMw(ibv_qp* qp, ibv_mw* mw, ibv_mw_bind* bind);
// The QP's link key, if it has one, into *key (if non-null); returns its serial, else 0.
uint64_t LinkKeyOf(SoftQp* qp, LinkKey* key);
// Whether candidate `c` is the peer `qp` was told about at RTR (QPN and GID) and proved the
// key the QP has, or none if it has none. Caller holds qp->lock.
bool IsExpectedPeer(SoftQp* qp, const PeerSegment& c);
// Progress on `qp`; the caller holds qp->lock. Returns true if anything happened.
// ProgressLocked is inline because every poll runs it, and most polls find nothing: the steady
// state (Normal) with no frame on either ring, nothing queued and no send completion wanted
// costs a few loads and no call. ProgressNormal does the steady state's work, ProgressSlow
// everything else (linking, errors, a peer gone, RNR waits, NAKs still to send).
bool ProgressNormal(SoftQp* qp, bool responses_ready, bool requests_ready);
bool ProgressSlow(SoftQp* qp);

// Linked, RTS, and nothing exceptional pending (an armed process's QPs never are: faults.cc).
inline bool Normal(const SoftQp* qp) {
  return qp->linked && qp->qstate == IBV_QPS_RTS && !qp->pending_nak.active &&
         qp->faults.load(std::memory_order_relaxed) == nullptr &&
         !qp->cur_read.active && !qp->rnr_waiting && !qp->cq_overflow &&
         !qp->link_event.load(std::memory_order_relaxed) &&
         !qp->peer_gone.load(std::memory_order_relaxed) &&
         qp->peer.control()->state.value.load(std::memory_order_relaxed) == wire::kLinkActive;
}

// Whether anyone is waiting for a send completion right now: a signaled request is
// outstanding, or the send queue needs its slots back. Otherwise piggybacked acks are enough
// and the peer's ack word (a cache line the peer writes on every message) is not read.
inline bool CompletionWanted(const SoftQp* qp) {
  if (qp->sig_all || qp->failure_pending ||
      qp->sq_tail - qp->sq_released.load(std::memory_order_relaxed) > qp->max_send_wr / 2) {
    return true;
  }
  // Any signaled WQE still outstanding (the SQ completes in order, so the newest one is
  // outstanding exactly when some is): its completion must not wait for a frame from a peer
  // that may never send one.
  return qp->newest_signaled - qp->sq_head < qp->sq_tail - qp->sq_head;
}

// `sink`: the array of the poll running this progress, if any (PollSink).
inline bool ProgressLocked(SoftQp* qp, PollSink* sink = nullptr) {
  const bool normal = Normal(qp);
  bool responses = false;
  bool requests = false;
  if (normal) {
    responses = qp->resp_rx.Ready();
    requests = qp->req_rx.Ready();
    // Without a frame or a queued send, only the peer's ack word can complete a send, and it is
    // read only when a completion is wanted (CompleteSq).
    if (!responses && !requests && qp->sq_tx == qp->sq_tail &&
        (qp->sq_head == qp->sq_tx || !CompletionWanted(qp))) {
      qp->lock.PublishIdle(qp->req_rx.stamp_word(), qp->req_rx.expected_stamp(),
                           qp->resp_rx.stamp_word(), qp->resp_rx.expected_stamp(),
                           &qp->peer.control()->state.value);
      return false;
    }
  }
  qp->poll_sink = sink;
  const bool did = normal ? ProgressNormal(qp, responses, requests) : ProgressSlow(qp);
  qp->poll_sink = nullptr;
  return did;
}
// Flushes anything pending for a QP whose CQ overflowed.
void FailQpLocked(SoftQp* qp, ibv_wc_status status);

// faults.cc: injected faults and the transport timer (soft_device.h). A QP created in an armed
// process gets its QpFaults (and any SWIRL_SOFT_FAULTS rule that names it) here; DestroyQp frees
// them. Called by CreateQp before the QP is published.
void AttachFaults(SoftQp* qp, uint64_t ordinal);
// SWIRL_SOFT_FAULTS is well-formed (or unset); else why not. Checked when a device opens.
absl::Status CheckFaultEnvironment();
// ProgressSlow's part (QP lock held), before anything else moves: acts on a fault that fired,
// and returns true while the QP is frozen (a stall or a drop): then nothing else may move.
bool FaultsBeforeProgress(SoftQp* qp, QpFaults* f);
// RC's transport timer (QP lock held, after the QP's progress): fails the oldest outstanding
// request with IBV_WC_RETRY_EXC_ERR, and the QP, when nothing from the peer has moved for it
// for ACK timeout x (retry_cnt + 1); returns true if it did. Every QP runs it: ProgressNormal
// every kTimerEveryStalledPolls polls that find its requests outstanding and nothing moving
// (qp.cc), ProgressSlow at every progress of a QP with faults armed.
bool RunTransportTimer(SoftQp* qp);
// RESET: the QP's link is gone; a fault that fired is over, one not yet fired stays armed.
void ResetFaults(QpFaults* f);
// ACK timeout of `attr` (qp.cc): 4.096 us x 2^timeout, 0 for timeout 0 (infinite).
int64_t AckTimeoutNs(const ibv_qp_attr& attr);

// qp_ex.cc: ibv_create_qp_ex (verbs_context::create_qp_ex). RC QPs with a PD, optionally with
// the ibv_wr_* builders (IBV_QP_INIT_ATTR_SEND_OPS_FLAGS); returns nullptr with errno set
// (EOPNOTSUPP for what the soft device does not do: other QP types, XRC, RSS, TSO, create flags,
// send ops other than RC's).
ibv_qp* CreateQpEx(ibv_context* context, ibv_qp_init_attr_ex* attr);

// cq_ex.cc: ibv_create_cq_ex (verbs_context::create_cq_ex); nullptr with errno set (EOPNOTSUPP
// for completion timestamps, CVLAN, flow tags, tag matching, parent domains, ignored overrun).
ibv_cq_ex* CreateCqEx(ibv_context* context, ibv_cq_init_attr_ex* attr);

// srq.cc
int ModifySrq(ibv_srq* srq, ibv_srq_attr* attr, int mask);
int QuerySrq(ibv_srq* srq, ibv_srq_attr* attr);
void RaiseSrqLimitReached(SoftSrq* srq);

// cq.cc
int CreateCq(SoftContext* sctx, int cqe, void* cq_context, ibv_comp_channel* channel, ibv_cq** out);
int DestroyCq(ibv_cq* cq);
// ibv_resize_cq: room for at least `cqe`, keeping the queued completions in order; EINVAL if
// more than `cqe` are queued. cq->cqe reports the new size.
int ResizeCq(ibv_cq* cq, int cqe);
int PollCq(ibv_cq* cq, int n, ibv_wc* wc);
int ReqNotifyCq(ibv_cq* cq, int solicited_only);
int CreateChannel(SoftContext* sctx, ibv_comp_channel** out);
int DestroyChannel(ibv_comp_channel* channel);
int GetCqEvent(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context);
void AckCqEvents(ibv_cq* cq, unsigned int count);
void AttachQp(SoftCq* cq, SoftQp* qp);
void DetachQp(SoftCq* cq, SoftQp* qp);
// Drops queued completions that name `qp` (it is being destroyed).
void PurgeQp(SoftCq* cq, SoftQp* qp);

// memory.cc
int RegMr(SoftContext* sctx, ibv_pd* pd, void* addr, size_t length, int access, ibv_mr** out);
int DeregMr(ibv_mr* mr);
// ibv_rereg_mr's semantics (libibverbs' checks included, and its updates of mr->pd, addr and
// length), with the provider convention of 0 or a positive errno: EINVAL for bad flags or
// arguments, EFAULT for an unmapped range, EBUSY while memory windows are bound over the region.
// The keys stay the same. On an error nothing changed and the region remains usable.
int ReregMr(ibv_mr* mr, int flags, ibv_pd* pd, void* addr, size_t length, int access);
ibv_mw* AllocMw(ibv_pd* pd, ibv_mw_type type);
// At the post of a type 2 bind with `rkey` (the QP's lock held): the slot the bind lands in
// (the window's, or the fresh one FreshWindowRkey reserved: the window moves there now), with
// the slot it leaves in w.bind_from.
void PrepareType2Bind(SoftMw* mw, uint32_t rkey, SendWqe& w);
// A type 2 window's slot was just unbound: released if the window had left it. mw_mu held.
void ReleaseIfRetired(KeyTable& keys, KeyEntry* e);
int DeallocMw(ibv_mw* mw);

}  // namespace swirl::soft

#endif  // SWIRL_TRANSPORT_SOFT_SOFT_INTERNAL_H_
