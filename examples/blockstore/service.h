// The server side of swirl.blockstore.BlockStore over a VolumeSet.
//
// Read/Write run on the polling worker and serve in-memory volumes: a memcpy between the volume
// and registered memory, nothing that blocks. File-backed volumes are served by ReadBlocking and
// WriteBlocking on the handler thread pool (pread/pwrite can wait for the disk); Read/Write refuse
// them with FAILED_PRECONDITION. See blockstore.proto.
//
// Tenants: a volume may have an owner, a principal of the server (ServerOptions::principals):
// only callers authenticated as that principal (ServerContext::principal()) may read, write or
// stat it; anyone else gets PERMISSION_DENIED, and ListVolumes does not show it to them. A
// volume without an owner is everyone's.

#ifndef SWIRL_EXAMPLES_BLOCKSTORE_SERVICE_H_
#define SWIRL_EXAMPLES_BLOCKSTORE_SERVICE_H_

#include "examples/blockstore/blockstore.pb.h"
#include "examples/blockstore/blockstore.swirl.h"
#include "absl/container/flat_hash_map.h"
#include "examples/blockstore/volume.h"

namespace swirl::blockstore {

class BlockStoreServer final : public BlockStoreService {
 public:
  // Volume name -> the principal that owns it.
  using Owners = absl::flat_hash_map<std::string, std::string>;

  explicit BlockStoreServer(const VolumeSet* volumes, Owners owners = {})
      : volumes_(volumes), owners_(std::move(owners)) {}

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
  absl::StatusOr<Volume*> Lookup(const ServerContext& ctx, const std::string& name,
                                 bool on_worker, const char* method);
  // The volume `name` if the caller may use it: NOT_FOUND, or PERMISSION_DENIED when another
  // principal owns it.
  absl::StatusOr<Volume*> Authorized(const ServerContext& ctx, const std::string& name) const;
  bool MayUse(const ServerContext& ctx, const std::string& name) const;

  const VolumeSet* volumes_;
  const Owners owners_;  // read-only once serving: no lock on the request path
};

}  // namespace swirl::blockstore

#endif  // SWIRL_EXAMPLES_BLOCKSTORE_SERVICE_H_
