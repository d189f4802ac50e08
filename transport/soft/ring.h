// Single-producer single-consumer frame rings over shared memory (see wire.h for the format).
//
// RingWriter runs in the process that owns the segment; RingReader in the peer, over a
// read-only mapping. Neither allocates, locks or makes a syscall; the caller (a QP, under its
// lock) supplies the ordering between them through the stamp protocol described in wire.h.

#ifndef SWIRL_TRANSPORT_SOFT_RING_H_
#define SWIRL_TRANSPORT_SOFT_RING_H_

#include <atomic>
#include <cstdint>
#include <cstring>

#include "transport/soft/wire.h"

namespace swirl::soft {

class RingWriter;

// Injected faults (faults.cc) see each frame a QP writes through this, before its stamp.
class CommitHook {
 public:
  // False: the stamp is held back (the hook stamps it later with RingWriter::StampHeld, or the
  // frame is never seen). The frame's bytes may be changed.
  virtual bool BeforeStamp(RingWriter& ring, char* frame, uint64_t pos) = 0;

 protected:
  ~CommitHook() = default;
};

class RingWriter {
 public:
  // `base` is `size` bytes of the owner's segment; `size` a power of two.
  void Init(char* base, uint64_t size) {
    base_ = base;
    size_ = size;
    head_ = 0;
    consumed_cache_ = 0;
    consumed_ = nullptr;
    consumer_lied_ = false;
  }
  // Where the consumer publishes how far it has read (in the peer's segment). Until it is
  // known, nothing counts as consumed, so at most one ring's worth is written ahead.
  void SetConsumedSource(const std::atomic<uint64_t>* consumed) { consumed_ = consumed; }

  // Returns `bytes` (a multiple of wire::kFrameAlign, at most size/2) of contiguous space for a frame and its
  // position, first writing a PAD frame over a too-short ring tail; nullptr if the consumer has
  // not yet freed enough.
  char* Reserve(uint64_t bytes, uint64_t* pos, uint32_t ack) {
    uint64_t offset = head_ & (size_ - 1);
    uint64_t pad = (offset + bytes > size_) ? size_ - offset : 0;
    if (!HasSpace(pad + bytes)) return nullptr;
    if (pad != 0) {
      auto* header = reinterpret_cast<wire::FrameHeader*>(base_ + offset);
      std::memset(reinterpret_cast<char*>(header) + 8, 0, sizeof(*header) - 8);
      header->op = wire::kOpPad;
      header->ack = ack;
      Stamp(header, head_);
      head_ += pad;
    }
    *pos = head_;
    return base_ + (head_ & (size_ - 1));
  }

  // Publishes the frame written at `frame` (from Reserve) as `bytes` long.
  void Commit(char* frame, uint64_t pos, uint64_t bytes) {
    // A QP without an injected fault pays this one predictable branch.
    if (hook_ != nullptr) [[unlikely]] {
      CommitHooked(frame, pos, bytes);
      return;
    }
    Stamp(reinterpret_cast<wire::FrameHeader*>(frame), pos);
    head_ = pos + bytes;
  }
  // Stamps a frame whose stamp a CommitHook held back.
  void StampHeld(char* frame, uint64_t pos) {
    Stamp(reinterpret_cast<wire::FrameHeader*>(frame), pos);
  }
  // Survives Init: a fault armed before the QP's segment exists watches its rings from the start.
  void SetCommitHook(CommitHook* hook) { hook_ = hook; }

  uint64_t head() const { return head_; }
  uint64_t size() const { return size_; }
  // Bytes written but not yet consumed, as last seen.
  uint64_t InFlight() const { return head_ - consumed_cache_; }
  // The consumer published a position it cannot be at: beyond what was written, or behind one
  // it published before. Such a value is never taken (it would free space the consumer may
  // still read, and the next frames would overwrite frames it has not read), and a correct
  // consumer never publishes one, so the writer's QP fails on it (qp.cc, ConsumerLied) rather
  // than wait for room that will not come. Sticky until Init.
  bool consumer_lied() const { return consumer_lied_; }

 private:
  bool HasSpace(uint64_t bytes) {
    if (head_ + bytes - consumed_cache_ <= size_) return true;
    if (consumed_ == nullptr) return false;
    uint64_t consumed = consumed_->load(std::memory_order_acquire);
    wire::SharedAcquire();
    // A peer may publish anything; never trust a value that would over-release space.
    if (consumed > head_ || consumed < consumed_cache_) {
      consumer_lied_ = true;
      return false;
    }
    consumed_cache_ = consumed;
    return head_ + bytes - consumed_cache_ <= size_;
  }
  // Commit with a hook: out of line, so that the common path stays as it was.
  [[gnu::noinline]] void CommitHooked(char* frame, uint64_t pos, uint64_t bytes) {
    head_ = pos + bytes;
    if (hook_->BeforeStamp(*this, frame, pos)) Stamp(reinterpret_cast<wire::FrameHeader*>(frame), pos);
  }
  static void Stamp(wire::FrameHeader* header, uint64_t pos) {
    wire::SharedRelease();
    __atomic_store_n(&header->stamp, wire::kStampValid | pos, __ATOMIC_RELEASE);
  }

  char* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t head_ = 0;
  uint64_t consumed_cache_ = 0;
  const std::atomic<uint64_t>* consumed_ = nullptr;
  bool consumer_lied_ = false;
  CommitHook* hook_ = nullptr;
};

class RingReader {
 public:
  void Init(const char* base, uint64_t size) {
    base_ = base;
    size_ = size;
    tail_ = 0;
  }
  bool attached() const { return base_ != nullptr; }

  // Copies out the next frame's header if its stamp says it is published. The copy is what the
  // caller validates; the shared header may change under it.
  bool Peek(wire::FrameHeader* header) const {
    const char* frame = base_ + (tail_ & (size_ - 1));
    uint64_t stamp = __atomic_load_n(reinterpret_cast<const uint64_t*>(frame), __ATOMIC_ACQUIRE);
    if (stamp != (wire::kStampValid | tail_)) return false;
    wire::SharedAcquire();
    std::memcpy(header, frame, sizeof(*header));
    header->stamp = stamp;
    return true;
  }
  // True if the next frame's stamp is published (one load; for the idle poll).
  bool Ready() const {
    const char* frame = base_ + (tail_ & (size_ - 1));
    __builtin_prefetch(frame + wire::kCacheLine);
    const bool ready = __atomic_load_n(reinterpret_cast<const uint64_t*>(frame),
                                       __ATOMIC_ACQUIRE) == (wire::kStampValid | tail_);
    if (ready) wire::SharedAcquire();
    return ready;
  }
  const char* frame() const { return base_ + (tail_ & (size_ - 1)); }
  // Where the next frame's stamp will appear, and the value it will have (QpLock's idle hint).
  const uint64_t* stamp_word() const { return reinterpret_cast<const uint64_t*>(frame()); }
  uint64_t expected_stamp() const { return wire::kStampValid | tail_; }
  // Bytes from the current frame to the end of the ring: no frame may be longer.
  uint64_t ContiguousBytes() const { return size_ - (tail_ & (size_ - 1)); }
  void Consume(uint64_t bytes) { tail_ += bytes; }
  uint64_t tail() const { return tail_; }

 private:
  const char* base_ = nullptr;
  uint64_t size_ = 0;
  uint64_t tail_ = 0;
};

}  // namespace swirl::soft

#endif  // SWIRL_TRANSPORT_SOFT_RING_H_
