#include "examples/blockstore/service.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "examples/blockstore/checksum.h"

namespace swirl::blockstore {
namespace {

inline void Bump(std::atomic<uint64_t>& counter, uint64_t n = 1) {
  counter.fetch_add(n, std::memory_order_relaxed);
}

// Counts a refused or failed request against its volume.
absl::Status Failed(Volume* volume, absl::Status status) {
  if (volume != nullptr) Bump(volume->counters().errors);
  return status;
}

}  // namespace

bool BlockStoreServer::MayUse(const ServerContext& ctx, const std::string& name) const {
  auto it = owners_.find(name);
  return it == owners_.end() || it->second == ctx.principal();
}

absl::StatusOr<Volume*> BlockStoreServer::Authorized(const ServerContext& ctx,
                                                     const std::string& name) const {
  Volume* volume = volumes_->Find(name);
  if (volume == nullptr) return absl::NotFoundError(absl::StrCat("no volume '", name, "'"));
  if (!MayUse(ctx, name)) {
    // Not counted against the volume: its owner's error count is not another tenant's to raise.
    return absl::PermissionDeniedError(
        absl::StrCat("volume '", name, "' belongs to another principal"));
  }
  return volume;
}

absl::StatusOr<Volume*> BlockStoreServer::Lookup(const ServerContext& ctx,
                                                 const std::string& name, bool on_worker,
                                                 const char* method) {
  auto authorized = Authorized(ctx, name);
  if (!authorized.ok()) return authorized.status();
  Volume* volume = *authorized;
  if (on_worker && volume->blocking()) {
    // Never block a polling worker: file I/O belongs on the handler pool.
    return Failed(volume, absl::FailedPreconditionError(absl::StrFormat(
                              "volume '%s' is file-backed (VolumeInfo.blocking): use %sBlocking",
                              name, method)));
  }
  if (!on_worker && !volume->blocking()) {
    // And the other way round: an in-memory volume's extent locks are taken by workers only.
    // A pool thread holding one (descheduled mid-copy, or one of many readers that keep a
    // writer out) would stall the worker that waits for it, and every connection on it.
    return Failed(volume, absl::FailedPreconditionError(absl::StrFormat(
                              "volume '%s' is in memory (VolumeInfo.blocking false): use %s",
                              name, method)));
  }
  return volume;
}

absl::Status BlockStoreServer::DoRead(ServerContext& ctx, const ReadRequest& request,
                                      ReadResponse* response, bool on_worker) {
  auto volume = Lookup(ctx, request.volume(), on_worker, "Read");
  if (!volume.ok()) return volume.status();
  Volume* v = *volume;
  if (absl::Status s = ValidateIo(v->size(), request.offset(), request.length()); !s.ok()) {
    return Failed(v, s);
  }
  const uint32_t length = request.length();
  // Zero copy: the block goes straight into the registered buffer the client will RDMA-READ
  // (or that is RDMA-written into the client's buffer in mirror mode).
  auto out = ctx.AllocateResponseBulk(length);
  if (!out.ok()) return Failed(v, out.status());
  BulkBuffer* data = *out;
  if (absl::Status s = v->Read(request.offset(), length, data->data()); !s.ok()) {
    return Failed(v, s);
  }
  data->resize(length);
  response->set_length(length);
  response->set_crc32c(Crc32c(data->data(), length));
  Bump(v->counters().reads);
  Bump(v->counters().bytes_read, length);
  return absl::OkStatus();
}

absl::Status BlockStoreServer::DoWrite(ServerContext& ctx, const WriteRequest& request,
                                       WriteResponse* response, bool on_worker) {
  auto volume = Lookup(ctx, request.volume(), on_worker, "Write");
  if (!volume.ok()) return volume.status();
  Volume* v = *volume;
  if (absl::Status s = ValidateIo(v->size(), request.offset(), request.length()); !s.ok()) {
    return Failed(v, s);
  }
  // The data came by RDMA into registered memory; by the time the handler runs, the window it
  // came through is revoked, so the client can no longer change it.
  BulkBuffer* data = ctx.request_bulk();
  if (data == nullptr) {
    return Failed(v,
                  absl::InvalidArgumentError(
                      "Write carries its data as a bulk attachment (CallOptions::request_bulk)"));
  }
  if (data->size() != request.length()) {
    return Failed(
        v, absl::InvalidArgumentError(absl::StrCat("the attachment has ", data->size(),
                                                   " bytes, the request says ", request.length())));
  }
  const uint32_t crc = Crc32c(data->data(), data->size());
  if (request.has_crc32c() && crc != request.crc32c()) {
    return Failed(v, absl::DataLossError(absl::StrFormat(
                         "data arrived with CRC32C 0x%08x, the client sent 0x%08x; not written",
                         crc, request.crc32c())));
  }
  if (absl::Status s = v->Write(request.offset(), request.length(), data->data()); !s.ok()) {
    return Failed(v, s);
  }
  response->set_length(request.length());
  response->set_crc32c(crc);
  Bump(v->counters().writes);
  Bump(v->counters().bytes_written, request.length());
  return absl::OkStatus();
}

absl::Status BlockStoreServer::Read(ServerContext& ctx, const ReadRequest& request,
                                    ReadResponse* response) {
  return DoRead(ctx, request, response, /*on_worker=*/true);
}

absl::Status BlockStoreServer::Write(ServerContext& ctx, const WriteRequest& request,
                                     WriteResponse* response) {
  return DoWrite(ctx, request, response, /*on_worker=*/true);
}

absl::Status BlockStoreServer::ReadBlocking(ServerContext& ctx, const ReadRequest& request,
                                            ReadResponse* response) {
  return DoRead(ctx, request, response, /*on_worker=*/false);
}

absl::Status BlockStoreServer::WriteBlocking(ServerContext& ctx, const WriteRequest& request,
                                             WriteResponse* response) {
  return DoWrite(ctx, request, response, /*on_worker=*/false);
}

void BlockStoreServer::Describe(Volume& volume, VolumeInfo* info) {
  info->set_name(volume.name());
  info->set_size(volume.size());
  info->set_backing(volume.file_backed() ? BACKING_FILE : BACKING_MEMORY);
  info->set_path(volume.path());
  info->set_blocking(volume.blocking());
  info->set_block_size(kBlockSize);
  info->set_max_io_size(kMaxIoSize);
  Volume::Counters& c = volume.counters();
  info->set_reads(c.reads.load(std::memory_order_relaxed));
  info->set_writes(c.writes.load(std::memory_order_relaxed));
  info->set_bytes_read(c.bytes_read.load(std::memory_order_relaxed));
  info->set_bytes_written(c.bytes_written.load(std::memory_order_relaxed));
  info->set_errors(c.errors.load(std::memory_order_relaxed));
}

absl::Status BlockStoreServer::Stat(ServerContext& ctx, const StatRequest& request,
                                    StatResponse* response) {
  auto volume = Authorized(ctx, request.volume());
  if (!volume.ok()) return volume.status();
  Describe(**volume, response->mutable_volume());
  return absl::OkStatus();
}

absl::Status BlockStoreServer::ListVolumes(ServerContext& ctx, const ListVolumesRequest&,
                                           ListVolumesResponse* response) {
  for (Volume* volume : volumes_->volumes()) {
    if (MayUse(ctx, volume->name())) Describe(*volume, response->add_volumes());
  }
  return absl::OkStatus();
}

}  // namespace swirl::blockstore
