// The demo's Blob service (blob.proto): one blob in memory, replaced by Put and returned by Get,
// both zero-copy bulk attachments. Served by echo_server beside Echo.

#ifndef SWIRL_EXAMPLES_ECHO_BLOB_SERVICE_H_
#define SWIRL_EXAMPLES_ECHO_BLOB_SERVICE_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/string_view.h"
#include "base/mutex.h"
#include "examples/echo/blob.swirl.h"

namespace swirl::examples {

// FNV-1a 64: the checksum the demo, its hostile client and the server compare.
inline uint64_t Fnv1a(absl::string_view data) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : data) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

class BlobServiceImpl final : public BlobService {
 public:
  // The request's attachment arrived by RDMA WRITE through a window granted for it; the
  // SEND_WITH_INV that carried this request revoked that window, so the client can no longer
  // change the data while we copy it.
  absl::Status Put(ServerContext& ctx, const PutRequest&, PutResponse* response) override {
    BulkBuffer* in = ctx.request_bulk();
    if (in == nullptr) {
      return absl::InvalidArgumentError("Put carries its data as a bulk attachment");
    }
    const absl::string_view data = in->view();
    MutexLock lock(&mu_);
    blob_.assign(data.data(), data.size());
    response->set_size(blob_.size());
    response->set_fnv1a(Fnv1a(blob_));
    return absl::OkStatus();
  }

  // A copy of the blob goes into a registered buffer; the server binds a window over exactly
  // that buffer for this request, and the client's SEND_WITH_INV after its READ revokes it.
  absl::Status Get(ServerContext& ctx, const GetRequest&, GetResponse* response) override {
    MutexLock lock(&mu_);
    auto out = ctx.AllocateResponseBulk(blob_.size());
    if (!out.ok()) return out.status();
    std::memcpy((*out)->data(), blob_.data(), blob_.size());
    (*out)->resize(blob_.size());
    response->set_size(blob_.size());
    response->set_fnv1a(Fnv1a(blob_));
    return absl::OkStatus();
  }

 private:
  Mutex mu_;
  std::string blob_ ABSL_GUARDED_BY(mu_);
};

}  // namespace swirl::examples

#endif  // SWIRL_EXAMPLES_ECHO_BLOB_SERVICE_H_
