// Internal: the ResponseWriter handlers write into. Small responses go straight into the
// message that will be sent (the inline arena, or a send buffer); a response above the eager
// threshold is written into registered bulk memory instead and leaves through a window.

#ifndef SWIRL_RPC_WRITER_H_
#define SWIRL_RPC_WRITER_H_

#include <algorithm>
#include <cstring>

#include "rpc/worker.h"

namespace swirl::internal {

// ResponseWriter straight into the outgoing message: the inline arena while it fits, else a
// send-pool buffer. Nothing is copied twice for small responses.
class Worker::Writer final : public ResponseWriter {
  static constexpr uint32_t kHeader = sizeof(rpc_wire::MessageHeader);

 public:
  Writer(Worker* worker, Connection* c) : worker_(worker), c_(c) {}
  ~Writer() override { Abandon(); }

  char* Reserve(size_t size) override {
    if (in_bulk_ || (length_ + size > c_->negotiated_.eager_threshold() &&
                     worker_->bulk_pool_ != nullptr && c_->negotiated_.max_bulk_size() > 0)) {
      return ReserveBulk(size);
    }
    if (length_ + size > c_->max_payload_) return nullptr;
    const uint32_t needed = static_cast<uint32_t>(kHeader + length_ + size);
    if (data_ == nullptr) {
      data_ = worker_->AllocMessage(c_, needed, &buffer_);
      if (data_ == nullptr) return nullptr;
      capacity_ = buffer_ < 0 ? worker_->max_inline_ : worker_->send_pool_->size();
    } else if (needed > capacity_) {
      if (buffer_ >= 0 || worker_->send_pool_->empty()) return nullptr;
      // Outgrew the inline slot: move to a send buffer.
      uint32_t index = worker_->send_pool_->Take();
      char* bigger = worker_->send_pool_->at(index);
      std::memcpy(bigger, data_, kHeader + length_);
      data_ = bigger;
      buffer_ = static_cast<int32_t>(index);
      capacity_ = worker_->send_pool_->size();
      if (needed > capacity_) return nullptr;
    }
    return data_ + kHeader + length_;
  }
  void Commit(size_t size) override {
    length_ += static_cast<uint32_t>(size);
    if (in_bulk_) bulk_.resize(length_);
  }

  // Releases the space without sending (one-way methods, failures).
  void Abandon() {
    if (buffer_ >= 0) worker_->send_pool_->Give(static_cast<uint32_t>(buffer_));
    buffer_ = -1;
    data_ = nullptr;
    bulk_.Release();
    in_bulk_ = false;
    length_ = 0;
  }
  // A response above the eager threshold was written into registered memory instead.
  bool in_bulk() const { return in_bulk_; }
  BulkBuffer TakeBulk() {
    in_bulk_ = false;
    length_ = 0;
    return std::move(bulk_);
  }
  // Hands the message over to the send path.
  void Release() {
    data_ = nullptr;
    buffer_ = -1;
  }
  char* data() const { return data_; }
  int32_t buffer() const { return buffer_; }
  uint32_t length() const { return length_; }

 private:
  char* ReserveBulk(size_t size) {
    const size_t needed = length_ + size;
    if (needed > c_->negotiated_.max_bulk_size()) return nullptr;
    if (!in_bulk_ || needed > bulk_.capacity()) {
      auto bigger = worker_->bulk_pool_->Allocate(std::max<size_t>(needed, 2 * length_));
      if (!bigger.ok()) return nullptr;
      // Whatever was written so far (eagerly or in a smaller bulk buffer) moves along.
      if (length_ > 0) std::memcpy(bigger->data(), in_bulk_ ? bulk_.data() : data_ + kHeader, length_);
      if (!in_bulk_ && buffer_ >= 0) worker_->send_pool_->Give(static_cast<uint32_t>(buffer_));
      buffer_ = -1;
      data_ = nullptr;
      bulk_ = std::move(*bigger);
      in_bulk_ = true;
    }
    return bulk_.data() + length_;
  }

  Worker* worker_;
  Connection* c_;
  BulkBuffer bulk_;
  bool in_bulk_ = false;
  char* data_ = nullptr;
  int32_t buffer_ = -1;
  uint32_t capacity_ = 0;
  uint32_t length_ = 0;
};

}  // namespace swirl::internal

#endif  // SWIRL_RPC_WRITER_H_
