// A client library for swirl.blockstore.BlockStore: a connection, a stub, and synchronous
// Read/Write/Stat that pick the right method for each volume and verify checksums.
//
//   swirl::ChannelOptions options;
//   options.auth_token = "s3cret";
//   auto client = swirl::blockstore::BlockStoreClient::Connect("host:7200", options);
//   auto block = (*client)->AllocateBuffer(65536);            // registered memory
//   absl::Status s = (*client)->Read("vol0", 0, 65536, &*block);
//   ... block->data() holds the data, checked against the server's CRC32C ...
//
// Data never leaves registered memory: Read lands in the caller's BulkBuffer (by RDMA), Write
// sends the caller's BulkBuffer (by RDMA). For many calls in flight use stub() and the
// allocation-free async form directly (blockstore_load does), with ReadMethod/WriteMethod
// answered by IsBlocking().

#ifndef SWIRL_EXAMPLES_BLOCKSTORE_CLIENT_H_
#define SWIRL_EXAMPLES_BLOCKSTORE_CLIENT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "examples/blockstore/blockstore.pb.h"
#include "examples/blockstore/blockstore.swirl.h"
#include "swirl/channel.h"

namespace swirl::blockstore {

class BlockStoreClient {
 public:
  static absl::StatusOr<std::unique_ptr<BlockStoreClient>> Connect(const std::string& address,
                                                                   const ChannelOptions& options);
  explicit BlockStoreClient(std::shared_ptr<Channel> channel);

  Channel& channel() const { return *channel_; }
  BlockStoreStub& stub() { return stub_; }

  absl::StatusOr<std::vector<VolumeInfo>> ListVolumes(const CallOptions& options = {});
  // Asks the server every time (fresh counters); remembers whether the volume is blocking.
  absl::StatusOr<VolumeInfo> Stat(const std::string& volume, const CallOptions& options = {});
  // Whether `volume` is served by ReadBlocking/WriteBlocking (asked once, then remembered).
  absl::StatusOr<bool> IsBlocking(const std::string& volume);

  // Registered memory on this connection, for Read and Write data.
  absl::StatusOr<BulkBuffer> AllocateBuffer(size_t size);

  // Reads [offset, offset + length) of `volume` into `buffer` (from AllocateBuffer; capacity at
  // least `length`); buffer->size() becomes length. DATA_LOSS if the data received does not
  // match the server's CRC32C. `response` (optional) gets the server's answer.
  absl::Status Read(const std::string& volume, uint64_t offset, uint32_t length, BulkBuffer* buffer,
                    ReadResponse* response = nullptr, const CallOptions& options = {});
  // Writes data.view() at `offset` of `volume`. Sends the data's CRC32C so the server refuses
  // damaged data, and checks the CRC32C it answers with.
  absl::Status Write(const std::string& volume, uint64_t offset, const BulkBuffer& data,
                     WriteResponse* response = nullptr, const CallOptions& options = {});

 private:
  std::shared_ptr<Channel> channel_;
  BlockStoreStub stub_;
  swirl::Mutex mu_;
  std::map<std::string, bool> blocking_ ABSL_GUARDED_BY(mu_);
};

}  // namespace swirl::blockstore

#endif  // SWIRL_EXAMPLES_BLOCKSTORE_CLIENT_H_
