// Internal: the ResponseWriter handlers write into. Small responses go straight into the
// message that will be sent (the inline arena, or a send buffer); a response above the eager
// threshold is written into registered bulk memory instead and leaves through a window.

#ifndef SWIRL_RPC_WRITER_H_
#define SWIRL_RPC_WRITER_H_

#include <algorithm>
#include <cstring>
#include <optional>

#include "rpc/bulk_pool.h"
#include "rpc/connection.h"
#include "rpc/outbox.h"
#include "swirl/service.h"

namespace swirl::internal {

// ResponseWriter straight into the outgoing message: the inline arena while it fits, else a
// send-pool buffer. Nothing is copied twice for small responses. Loop thread only.
class MessageWriter final : public ResponseWriter {
  static constexpr uint32_t kHeader = sizeof(rpc_wire::MessageHeader);

 public:
  // `bulk`: the worker's bulk pool, or null.
  MessageWriter(Outbox* outbox, BulkPool* bulk, Connection* c)
      : outbox_(outbox), bulk_pool_(bulk), c_(c) {}
  // Abandon() without its stores into a writer that is going away (bulk_ releases itself).
  ~MessageWriter() override { outbox_->Give(buffer_); }

  // Takes an inline slot (or a send buffer) ahead of the handler, so that its first Reserve is
  // the inline one. Whatever a handler then writes, the slot goes with the response or back.
  void Prepare() {
    if (data_ != nullptr || in_bulk_) return;
    data_ = outbox_->Alloc(std::max<uint32_t>(outbox_->max_inline(), kHeader), &buffer_);
    if (data_ != nullptr) Place(data_ + kHeader, 0);
  }

  // Releases the space without sending (one-way methods, failures).
  void Abandon() {
    outbox_->Give(buffer_);
    buffer_ = -1;
    data_ = nullptr;
    bulk_.reset();
    in_bulk_ = false;
    Clear();
  }
  // A response above the eager threshold was written into registered memory instead.
  bool in_bulk() const { return in_bulk_; }
  BulkBuffer TakeBulk() {
    bulk_->resize(length());
    in_bulk_ = false;
    Clear();
    BulkBuffer taken = std::move(*bulk_);
    bulk_.reset();
    return taken;
  }
  // Hands the message over to the send path (read data(), buffer() and length() first).
  void Release() {
    data_ = nullptr;
    buffer_ = -1;
    Clear();
  }
  char* data() const { return data_; }
  int32_t buffer() const { return buffer_; }
  uint32_t length() const { return static_cast<uint32_t>(cursor_ - begin_); }

 private:
  char* ReserveSlow(size_t size) override {
    const uint32_t length = this->length();
    if (in_bulk_ || (length + size > c_->negotiated().eager_threshold() &&
                     bulk_pool_ != nullptr && c_->negotiated().max_bulk_size() > 0)) {
      return ReserveBulk(size);
    }
    if (length + size > c_->max_payload()) return nullptr;
    const uint32_t needed = static_cast<uint32_t>(kHeader + length + size);
    BufferPool& pool = outbox_->pool();
    if (data_ == nullptr) {
      data_ = outbox_->Alloc(needed, &buffer_);
      if (data_ == nullptr) return nullptr;
    } else if (needed > capacity()) {
      if (buffer_ >= 0 || pool.empty()) return nullptr;
      // Outgrew the inline slot: move to a send buffer.
      uint32_t index = pool.Take();
      char* bigger = pool.at(index);
      std::memcpy(bigger, data_, kHeader + length);
      data_ = bigger;
      buffer_ = static_cast<int32_t>(index);
    }
    Place(data_ + kHeader, length);
    if (needed > capacity()) return nullptr;
    return cursor_;
  }
  void CommitSlow(size_t size) override {
    // More than the last Reserve gave (a handler's bug; the bytes beyond were never ours to
    // send), or nothing reserved: what fits is taken, and no more.
    if (room_ > 0) {
      cursor_ += std::min(size, room_ - 1);
      room_ -= std::min(size, room_ - 1);
    }
  }
  uint32_t capacity() const {
    return buffer_ < 0 ? outbox_->max_inline() : outbox_->pool().size();
  }
  // The payload is at `begin`, `length` bytes of it written; the inline Reserve then takes
  // whatever stays within the space, within the message size limit, and (eagerly) at the eager
  // threshold when bulk is possible: one compare for the three.
  void Place(char* begin, uint32_t length) {
    size_t end;
    if (in_bulk_) {
      end = std::min<size_t>(bulk_->capacity(), c_->negotiated().max_bulk_size());
    } else {
      // eager_limit(): the eager threshold when bulk is possible (the writer's bulk pool is its
      // worker's), else the message size limit.
      end = std::min<size_t>(capacity() - kHeader, c_->eager_limit());
    }
    begin_ = begin;
    cursor_ = begin + length;
    room_ = end >= length ? end - length + 1 : 0;
  }
  void Clear() {
    begin_ = cursor_ = nullptr;
    room_ = 0;
  }
  char* ReserveBulk(size_t size) {
    const uint32_t length = this->length();
    const size_t needed = length + size;
    if (needed > c_->negotiated().max_bulk_size()) return nullptr;
    if (!in_bulk_ || needed > bulk_->capacity()) {
      auto bigger = bulk_pool_->Allocate(std::max<size_t>(needed, 2 * size_t{length}));
      if (!bigger.ok()) return nullptr;
      // Whatever was written so far (eagerly or in a smaller bulk buffer) moves along.
      if (length > 0) std::memcpy(bigger->data(), begin_, length);
      if (!in_bulk_) outbox_->Give(buffer_);
      buffer_ = -1;
      data_ = nullptr;
      bulk_ = std::move(*bigger);
      in_bulk_ = true;
      Place(bulk_->data(), length);
    }
    return cursor_;
  }

  Outbox* outbox_;
  BulkPool* bulk_pool_;
  Connection* c_;
  // Made only for a response that outgrows the eager threshold (in_bulk_): most writers need
  // none, and an empty BulkBuffer made and destroyed for each costs more than a flag.
  std::optional<BulkBuffer> bulk_;
  bool in_bulk_ = false;
  char* data_ = nullptr;  // the message (header first), when eager
  int32_t buffer_ = -1;
  char* begin_ = nullptr;  // the payload: data_ + kHeader, or bulk_.data()
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_WRITER_H_
