// Internal: the ResponseWriter handlers write into. Small responses go straight into the
// message that will be sent (the inline arena, or a send buffer); a response above the eager
// threshold is written into registered bulk memory instead and leaves through a window.

#ifndef SWIRL_RPC_WRITER_H_
#define SWIRL_RPC_WRITER_H_

#include <algorithm>
#include <cstring>

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
  ~MessageWriter() override { Abandon(); }

  // The common case first: the bytes fit the space taken already, below the eager threshold
  // and the message size limit (fast_end_ folds the three together, one past the largest
  // length they allow; 0 while there is no space, so that even Reserve(0) takes some then).
  char* Reserve(size_t size) override {
    if (length_ + size < fast_end_) [[likely]] return data_ + kHeader + length_;
    return ReserveSlow(size);
  }
  // Takes an inline slot (or a send buffer) ahead of the handler, so that its first Reserve is
  // the fast one. Whatever a handler then writes, the slot goes with the response or back.
  void Prepare() {
    if (data_ != nullptr || in_bulk_) return;
    data_ = outbox_->Alloc(std::max<uint32_t>(outbox_->max_inline(), kHeader), &buffer_);
    if (data_ != nullptr) SetFastEnd();
  }
  void Commit(size_t size) override {
    length_ += static_cast<uint32_t>(size);
    if (in_bulk_) bulk_.resize(length_);
  }

  // Releases the space without sending (one-way methods, failures).
  void Abandon() {
    outbox_->Give(buffer_);
    buffer_ = -1;
    data_ = nullptr;
    bulk_.Release();
    in_bulk_ = false;
    length_ = 0;
    fast_end_ = 0;
  }
  // A response above the eager threshold was written into registered memory instead.
  bool in_bulk() const { return in_bulk_; }
  BulkBuffer TakeBulk() {
    in_bulk_ = false;
    length_ = 0;
    fast_end_ = 0;
    return std::move(bulk_);
  }
  // Hands the message over to the send path.
  void Release() {
    data_ = nullptr;
    buffer_ = -1;
    fast_end_ = 0;
  }
  char* data() const { return data_; }
  int32_t buffer() const { return buffer_; }
  uint32_t length() const { return length_; }

 private:
  char* ReserveSlow(size_t size) {
    if (in_bulk_ || (length_ + size > c_->negotiated().eager_threshold() &&
                     bulk_pool_ != nullptr && c_->negotiated().max_bulk_size() > 0)) {
      return ReserveBulk(size);
    }
    if (length_ + size > c_->max_payload()) return nullptr;
    const uint32_t needed = static_cast<uint32_t>(kHeader + length_ + size);
    BufferPool& pool = outbox_->pool();
    if (data_ == nullptr) {
      data_ = outbox_->Alloc(needed, &buffer_);
      if (data_ == nullptr) return nullptr;
    } else if (needed > capacity()) {
      if (buffer_ >= 0 || pool.empty()) return nullptr;
      // Outgrew the inline slot: move to a send buffer.
      uint32_t index = pool.Take();
      char* bigger = pool.at(index);
      std::memcpy(bigger, data_, kHeader + length_);
      data_ = bigger;
      buffer_ = static_cast<int32_t>(index);
      if (needed > capacity()) return nullptr;
    }
    SetFastEnd();
    return data_ + kHeader + length_;
  }
  uint32_t capacity() const {
    return buffer_ < 0 ? outbox_->max_inline() : outbox_->pool().size();
  }
  // The largest length_ that the current space takes with no check but this one: within the
  // space, within the message size limit, and at the eager threshold when bulk is possible.
  void SetFastEnd() {
    size_t end = std::min<size_t>(capacity() - kHeader, c_->max_payload());
    if (bulk_pool_ != nullptr && c_->negotiated().max_bulk_size() > 0) {
      end = std::min<size_t>(end, c_->negotiated().eager_threshold());
    }
    fast_end_ = end + 1;
  }
  char* ReserveBulk(size_t size) {
    const size_t needed = length_ + size;
    if (needed > c_->negotiated().max_bulk_size()) return nullptr;
    if (!in_bulk_ || needed > bulk_.capacity()) {
      auto bigger = bulk_pool_->Allocate(std::max<size_t>(needed, 2 * length_));
      if (!bigger.ok()) return nullptr;
      // Whatever was written so far (eagerly or in a smaller bulk buffer) moves along.
      if (length_ > 0) std::memcpy(bigger->data(), in_bulk_ ? bulk_.data() : data_ + kHeader, length_);
      if (!in_bulk_) outbox_->Give(buffer_);
      buffer_ = -1;
      data_ = nullptr;
      fast_end_ = 0;
      bulk_ = std::move(*bigger);
      in_bulk_ = true;
    }
    return bulk_.data() + length_;
  }

  Outbox* outbox_;
  BulkPool* bulk_pool_;
  Connection* c_;
  BulkBuffer bulk_;
  bool in_bulk_ = false;
  char* data_ = nullptr;
  int32_t buffer_ = -1;
  size_t fast_end_ = 0;
  uint32_t length_ = 0;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_WRITER_H_
