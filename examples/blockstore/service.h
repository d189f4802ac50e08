// The server side of swirl.blockstore.BlockStore over a VolumeSet.
//
// Read/Write run on the polling worker and serve in-memory volumes: a memcpy between the volume
// and registered memory, nothing that blocks. File-backed volumes are served by ReadBlocking and
// WriteBlocking on the handler thread pool (pread/pwrite can wait for the disk); Read/Write refuse
// them with FAILED_PRECONDITION. See blockstore.proto.

#ifndef SWIRL_EXAMPLES_BLOCKSTORE_SERVICE_H_
#define SWIRL_EXAMPLES_BLOCKSTORE_SERVICE_H_

#include "examples/blockstore/blockstore.pb.h"
#include "examples/blockstore/blockstore.swirl.h"
#include "examples/blockstore/volume.h"

namespace swirl::blockstore {

class BlockStoreServer final : public BlockStoreService {
 public:
  explicit BlockStoreServer(const VolumeSet* volumes) : volumes_(volumes) {}

  absl::Status Read(ServerContext& ctx, const ReadRequest& request,
                    ReadResponse* response) override;
  absl::Status Write(ServerContext& ctx, const WriteRequest& request,
                     WriteResponse* response) override;
  absl::Status ReadBlocking(ServerContext& ctx, const ReadRequest& request,
                            ReadResponse* response) override;
  absl::Status WriteBlocking(ServerContext& ctx, const WriteRequest& request,
                             WriteResponse* response) override;
  absl::Status Stat(ServerContext& ctx, const StatRequest& request,
                    StatResponse* response) override;
  absl::Status ListVolumes(ServerContext& ctx, const ListVolumesRequest& request,
                           ListVolumesResponse* response) override;

  static void Describe(Volume& volume, VolumeInfo* info);

 private:
  absl::Status DoRead(ServerContext& ctx, const ReadRequest& request, ReadResponse* response,
                      bool on_worker);
  absl::Status DoWrite(ServerContext& ctx, const WriteRequest& request, WriteResponse* response,
                       bool on_worker);
  absl::StatusOr<Volume*> Lookup(const std::string& name, bool on_worker, const char* method);

  const VolumeSet* volumes_;
};

}  // namespace swirl::blockstore

#endif  // SWIRL_EXAMPLES_BLOCKSTORE_SERVICE_H_
