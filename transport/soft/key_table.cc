#include "transport/soft/key_table.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <new>

#include "absl/random/distributions.h"
#include "base/spinlock.h"

namespace swirl::soft {

KeyTable::KeyTable() {
  // Zero pages on demand: the table costs only what is touched.
  void* memory = mmap(nullptr, sizeof(KeyEntry) * kSlots, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (memory == MAP_FAILED) std::abort();
  entries_ = static_cast<KeyEntry*>(memory);
  memory = mmap(nullptr, sizeof(KeySlotExtra) * kSlots, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (memory == MAP_FAILED) std::abort();
  extras_ = static_cast<KeySlotExtra*>(memory);
}

KeyTable::~KeyTable() {
  munmap(entries_, sizeof(KeyEntry) * kSlots);
  munmap(extras_, sizeof(KeySlotExtra) * kSlots);
}

absl::StatusOr<KeyEntry*> KeyTable::Allocate(KeyKind kind) {
  swirl::MutexLock lock(&mu_);
  if (live_ + 1 >= kSlots) return absl::ResourceExhaustedError("soft device: no free memory keys");
  uint32_t slot = absl::Uniform<uint32_t>(bitgen_, 1, kSlots);
  // Linear probe from a random start; slot 0 is never used, so key 0 never names an entry.
  for (uint32_t tries = 0; tries < kSlots; ++tries, slot = (slot + 1) & (kSlots - 1)) {
    if (slot == 0) continue;
    KeyEntry* e = &entries_[slot];
    if (e->kind != KeyKind::kFree) continue;
    e->kind = kind;
    e->access = 0;
    e->addr = 0;
    e->length = 0;
    e->pd = nullptr;
    e->qp_serial = 0;
    e->mr = nullptr;
    KeySlotExtra& extra = extras_[slot];
    std::atomic_ref<int64_t>(extra.deadline_ns).store(0, std::memory_order_relaxed);
    ++extra.generation;
    extra.retired = false;
    std::atomic_ref<uint32_t>(e->bound_windows).store(0, std::memory_order_relaxed);
    uint32_t high = absl::Uniform<uint32_t>(bitgen_, 0, 1u << (24 - kSlotBits));
    e->index = (high << kSlotBits) | slot;
    ++live_;
    return e;
  }
  return absl::ResourceExhaustedError("soft device: no free memory keys");
}

void KeyTable::Release(KeyEntry* entry) {
  Revoke(entry);
  swirl::MutexLock lock(&mu_);
  entry->kind = KeyKind::kFree;
  --live_;
}

uint8_t KeyTable::RandomByte() {
  swirl::MutexLock lock(&mu_);
  return absl::Uniform<uint8_t>(bitgen_);
}

uint32_t KeyTable::NewKey(const KeyEntry* entry, uint32_t previous) {
  uint8_t byte;
  do {
    byte = RandomByte();
  } while (previous != 0 && byte == (previous & 0xff));
  return (entry->index << 8) | byte;
}

void KeyTable::Revoke(KeyEntry* e) {
  std::atomic_ref<uint32_t>(e->key).store(0, std::memory_order_seq_cst);
  while (std::atomic_ref<uint32_t>(e->users).load(std::memory_order_seq_cst) != 0) CpuRelax();
}

void KeyTable::Unbind(KeyEntry* window) {
  Revoke(window);
  if (window->mr != nullptr) {
    std::atomic_ref<uint32_t>(window->mr->bound_windows).fetch_sub(1, std::memory_order_acq_rel);
    window->mr = nullptr;
  }
  window->qp_serial = 0;
  window->length = 0;
}

uint32_t KeyTable::live() const {
  swirl::MutexLock lock(&mu_);
  return live_;
}

}  // namespace swirl::soft
