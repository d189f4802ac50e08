// Memory keys of one soft HCA: the table the responder consults for every remote access and the
// data path for every local SGE.
//
// A key is (index << 8) | key8, as on real devices. The index names a slot and carries random
// high bits; the slot is picked at random among the free ones and key8 is random, so keys are
// not predictable (ReDMArk, USENIX Security '21, guessed sequential rkeys). A lookup must match
// all 32 bits.
//
// Concurrency: data-path accesses Pin() an entry (one atomic increment, then a check that the
// key is still published) and Unpin() it after the copy. Revoke() unpublishes the key and waits
// for pinned users to drain, so once an invalidation or deregistration returns, no access with
// the old key is in flight or can start. Entries live in one zeroed allocation for the table's
// lifetime and are never freed individually, so a stale lookup always lands on valid memory.

#ifndef SWIRL_TRANSPORT_SOFT_KEY_TABLE_H_
#define SWIRL_TRANSPORT_SOFT_KEY_TABLE_H_

#include <atomic>
#include <cstdint>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"

namespace swirl::soft {

enum class KeyKind : uint8_t { kFree = 0, kMr, kMw1, kMw2 };

struct KeyEntry {
  // Accessed only through std::atomic_ref (the table is zero-filled memory).
  uint32_t key;    // the published key; 0: no access can succeed
  uint32_t users;  // pinned data-path accesses
  // Stable while the key is published; changed only by the owner after Revoke().
  KeyKind kind;
  int access;      // IBV_ACCESS_* granted
  uint64_t addr;
  uint64_t length;
  const void* pd;  // owning SoftPd
  // Type 2 windows: SoftQp::serial of the QP the window is bound to (0: none). A serial, not
  // the QP's address: a QP created after that one was destroyed may get its memory.
  uint64_t qp_serial;
  KeyEntry* mr;    // windows: the MR entry they are bound over
  uint32_t bound_windows;  // MRs: windows bound over it (atomic_ref)
  uint32_t index;  // the index this slot currently answers to
};
// One cache line, and a power of two: every lookup the data path makes indexes the table.
static_assert(sizeof(KeyEntry) == 64);

// What only windows and the control path need of a slot, in a table beside the entries (so
// that KeyEntry stays 64 bytes).
struct KeySlotExtra {
  // Windows: the lease (SetWindowDeadline), as NowNs(): from then on the responder refuses
  // every access through the window. 0: none. Accessed through std::atomic_ref.
  int64_t deadline_ns;
  // Bumped by every Allocate: tells a slot still held by what allocated it from one released
  // and allocated again (whose index may even be the same).
  uint64_t generation;
  // Type 2 windows: the window has moved on to another slot (FreshWindowRkey, memory.cc), and
  // this one is released once nothing is bound in it.
  bool retired;
};

class KeyTable {
 public:
  static constexpr int kSlotBits = 17;
  static constexpr uint32_t kSlots = 1u << kSlotBits;

  KeyTable();
  ~KeyTable();
  KeyTable(const KeyTable&) = delete;
  KeyTable& operator=(const KeyTable&) = delete;

  // Reserves a random free slot for `kind`; returns its entry (with `index` set). The entry's
  // key stays 0 until Publish().
  absl::StatusOr<KeyEntry*> Allocate(KeyKind kind);
  // Returns a revoked entry's slot to the free pool.
  void Release(KeyEntry* entry);

  // A fresh key for `entry`: its index with a random key byte different from `previous`'s.
  uint32_t NewKey(const KeyEntry* entry, uint32_t previous = 0);
  uint8_t RandomByte();

  // Data path.
  KeyEntry* Pin(uint32_t key) {
    if (key == 0) return nullptr;
    KeyEntry* e = &entries_[(key >> 8) & (kSlots - 1)];
    std::atomic_ref<uint32_t>(e->users).fetch_add(1, std::memory_order_seq_cst);
    if (std::atomic_ref<uint32_t>(e->key).load(std::memory_order_seq_cst) != key) {
      Unpin(e);
      return nullptr;
    }
    return e;
  }
  static void Unpin(KeyEntry* e) {
    std::atomic_ref<uint32_t>(e->users).fetch_sub(1, std::memory_order_release);
  }

  // Control path (callers serialize changes to one entry).
  static void Publish(KeyEntry* e, uint32_t key) {
    std::atomic_ref<uint32_t>(e->key).store(key, std::memory_order_release);
  }
  static void Revoke(KeyEntry* e);
  // A window's whole invalidation (the caller serializes window changes: Hca::mw_mu): Revoke,
  // then unbound from its region (which may be deregistered once no window is bound over it)
  // and from its QP.
  static void Unbind(KeyEntry* window);
  static uint32_t PublishedKey(KeyEntry* e) {
    return std::atomic_ref<uint32_t>(e->key).load(std::memory_order_acquire);
  }

  // The entry a key's index names (may be free or answer to another key: check it).
  KeyEntry* EntryFor(uint32_t key) { return &entries_[(key >> 8) & (kSlots - 1)]; }
  KeySlotExtra& Extra(const KeyEntry* e) { return extras_[e - entries_]; }

  uint32_t live() const;

 private:
  KeyEntry* entries_;
  KeySlotExtra* extras_;
  mutable swirl::Mutex mu_;
  uint32_t live_ ABSL_GUARDED_BY(mu_) = 0;
  absl::BitGen bitgen_ ABSL_GUARDED_BY(mu_);
};

// RAII pin for one data-path access.
class PinnedKey {
 public:
  PinnedKey(KeyTable& table, uint32_t key) : entry_(table.Pin(key)) {}
  ~PinnedKey() {
    if (entry_ != nullptr) KeyTable::Unpin(entry_);
  }
  PinnedKey(const PinnedKey&) = delete;
  PinnedKey& operator=(const PinnedKey&) = delete;
  KeyEntry* get() const { return entry_; }
  explicit operator bool() const { return entry_ != nullptr; }
  KeyEntry* operator->() const { return entry_; }

 private:
  KeyEntry* entry_;
};

}  // namespace swirl::soft

#endif  // SWIRL_TRANSPORT_SOFT_KEY_TABLE_H_
