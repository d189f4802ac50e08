// Zero-copy bulk payloads: registered memory that travels by RDMA through a memory window made
// for one request (docs/BULK.md).
//
// A payload above the negotiated eager threshold never goes through the message path: the side
// that holds it exposes exactly that buffer through a type 2 memory window with a fresh rkey,
// the other side RDMA-reads or -writes it, and the last message for the request is a
// SEND_WITH_INV carrying the rkey, so the window is revoked by the NIC as the message is
// delivered. This happens on its own for large protobuf messages (serialized straight into
// registered memory). For zero copy, attach a BulkBuffer: a storage server reads a block
// straight into the buffer the client will RDMA-READ, and a client receives into a buffer it
// chose.
//
//   auto block = channel->AllocateBulk(1 << 20);          // client side
//   CallOptions options;
//   options.response_bulk = &*block;                      // where Read's data lands
//   stub.Read(request, &response, options);
//
//   absl::Status Read(ServerContext& ctx, ...) {           // server side
//     auto out = ctx.AllocateResponseBulk(length);
//     pread(fd, (*out)->data(), length, offset);
//     ...

#ifndef SWIRL_RPC_BULK_H_
#define SWIRL_RPC_BULK_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/strings/string_view.h"

namespace swirl {

namespace internal {
class BulkPool;
}  // namespace internal

// A buffer in registered memory. Move-only; gives its memory back to its pool when destroyed
// (from any thread). It must not outlive the Channel or Server it came from.
class BulkBuffer {
 public:
  BulkBuffer() = default;
  // Inline: the message path moves and destroys several (mostly empty) buffers per call.
  BulkBuffer(BulkBuffer&& other) noexcept
      : pool_(std::move(other.pool_)),
        size_class_(other.size_class_),
        data_(other.data_),
        size_(other.size_),
        capacity_(other.capacity_) {
    other.Forget();
  }
  BulkBuffer& operator=(BulkBuffer&& other) noexcept {
    if (this != &other) {
      Release();
      pool_ = std::move(other.pool_);
      size_class_ = other.size_class_;
      data_ = other.data_;
      size_ = other.size_;
      capacity_ = other.capacity_;
      other.Forget();
    }
    return *this;
  }
  BulkBuffer(const BulkBuffer&) = delete;
  BulkBuffer& operator=(const BulkBuffer&) = delete;
  // Always inline: empty buffers are destroyed several times per call, and GCC otherwise
  // keeps this out of line for the shared_ptr release it contains.
  [[gnu::always_inline]] ~BulkBuffer() { Release(); }

  char* data() const { return data_; }
  size_t size() const { return size_; }
  size_t capacity() const { return capacity_; }
  // Sets the length of the payload (at most capacity()).
  void resize(size_t size) { size_ = size <= capacity_ ? size : capacity_; }
  absl::string_view view() const { return absl::string_view(data_, size_); }
  explicit operator bool() const { return data_ != nullptr; }

  // Gives the memory back now (a no-op on an empty buffer, inline: the message path destroys
  // several empty ones per call).
  void Release() {
    if (data_ != nullptr || pool_ != nullptr) ReleaseSlow();
  }

 private:
  friend class internal::BulkPool;
  void ReleaseSlow();
  // Leaves this buffer empty without giving anything back (its memory moved elsewhere).
  void Forget() {
    data_ = nullptr;
    size_ = capacity_ = 0;
    size_class_ = 0;
  }
  std::shared_ptr<internal::BulkPool> pool_;
  // Meaningful only while data_ is set. 0 otherwise, so that an empty buffer is all zeros: the
  // message path makes several per call, each then a few vector stores.
  int size_class_ = 0;
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

// How bulk payloads move on a channel.
enum class BulkMode {
  // The side holding the data exposes it; the other side's last message is SEND_WITH_INV
  // (server-exposed downloads, server-granted upload windows). The default.
  kServerExposes,
  // NFS/RDMA and SMB Direct style: the client exposes its buffers through its own per-request
  // windows and the server's reply is the SEND_WITH_INV.
  kMirror,
};

const char* BulkModeName(BulkMode mode);

}  // namespace swirl

#endif  // SWIRL_RPC_BULK_H_
