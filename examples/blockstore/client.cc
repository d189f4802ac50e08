#include "examples/blockstore/client.h"

#include "absl/strings/str_format.h"
#include "examples/blockstore/checksum.h"

namespace swirl::blockstore {

absl::StatusOr<std::unique_ptr<BlockStoreClient>> BlockStoreClient::Connect(
    const std::string& address, const ChannelOptions& options) {
  auto channel = Channel::Create(address, options);
  if (!channel.ok()) return channel.status();
  return std::make_unique<BlockStoreClient>(std::move(*channel));
}

BlockStoreClient::BlockStoreClient(std::shared_ptr<Channel> channel)
    : channel_(std::move(channel)), stub_(*channel_) {}

absl::StatusOr<std::vector<VolumeInfo>> BlockStoreClient::ListVolumes(const CallOptions& options) {
  ListVolumesResponse response;
  if (absl::Status s = stub_.ListVolumes(ListVolumesRequest(), &response, options); !s.ok()) {
    return s;
  }
  swirl::MutexLock lock(&mu_);
  for (const VolumeInfo& v : response.volumes()) blocking_[v.name()] = v.blocking();
  return std::vector<VolumeInfo>(response.volumes().begin(), response.volumes().end());
}

absl::StatusOr<VolumeInfo> BlockStoreClient::Stat(const std::string& volume,
                                                  const CallOptions& options) {
  StatRequest request;
  request.set_volume(volume);
  StatResponse response;
  if (absl::Status s = stub_.Stat(request, &response, options); !s.ok()) return s;
  swirl::MutexLock lock(&mu_);
  blocking_[volume] = response.volume().blocking();
  return response.volume();
}

absl::StatusOr<bool> BlockStoreClient::IsBlocking(const std::string& volume) {
  {
    swirl::MutexLock lock(&mu_);
    auto it = blocking_.find(volume);
    if (it != blocking_.end()) return it->second;
  }
  auto info = Stat(volume);
  if (!info.ok()) return info.status();
  return info->blocking();
}

absl::StatusOr<BulkBuffer> BlockStoreClient::AllocateBuffer(size_t size) {
  return channel_->AllocateBulk(size);
}

absl::Status BlockStoreClient::Read(const std::string& volume, uint64_t offset, uint32_t length,
                                    BulkBuffer* buffer, ReadResponse* response,
                                    const CallOptions& options) {
  if (buffer == nullptr || !*buffer || buffer->capacity() < length) {
    return absl::InvalidArgumentError(
        "Read needs a buffer from AllocateBuffer with room for the data");
  }
  auto blocking = IsBlocking(volume);
  if (!blocking.ok()) return blocking.status();
  ReadRequest request;
  request.set_volume(volume);
  request.set_offset(offset);
  request.set_length(length);
  ReadResponse local;
  ReadResponse* out = response != nullptr ? response : &local;
  CallOptions call_options = options;
  call_options.request_bulk = nullptr;
  buffer->resize(0);  // so that a response without data cannot pass for one with it
  call_options.response_bulk = buffer;
  absl::Status s = *blocking ? stub_.ReadBlocking(request, out, call_options)
                             : stub_.Read(request, out, call_options);
  if (!s.ok()) return s;
  if (buffer->size() != length || out->length() != length) {
    return absl::DataLossError(absl::StrFormat("asked for %u bytes, received %u (response says %u)",
                                               length, buffer->size(), out->length()));
  }
  const uint32_t crc = Crc32c(buffer->data(), buffer->size());
  if (crc != out->crc32c()) {
    return absl::DataLossError(absl::StrFormat(
        "data received has CRC32C 0x%08x, the server sent 0x%08x", crc, out->crc32c()));
  }
  return absl::OkStatus();
}

absl::Status BlockStoreClient::Write(const std::string& volume, uint64_t offset,
                                     const BulkBuffer& data, WriteResponse* response,
                                     const CallOptions& options) {
  if (!data) return absl::InvalidArgumentError("Write needs a buffer from AllocateBuffer");
  auto blocking = IsBlocking(volume);
  if (!blocking.ok()) return blocking.status();
  WriteRequest request;
  request.set_volume(volume);
  request.set_offset(offset);
  request.set_length(static_cast<uint32_t>(data.size()));
  const uint32_t crc = Crc32c(data.data(), data.size());
  request.set_has_crc32c(true);
  request.set_crc32c(crc);
  WriteResponse local;
  WriteResponse* out = response != nullptr ? response : &local;
  CallOptions call_options = options;
  call_options.request_bulk = &data;
  call_options.response_bulk = nullptr;
  absl::Status s = *blocking ? stub_.WriteBlocking(request, out, call_options)
                             : stub_.Write(request, out, call_options);
  if (!s.ok()) return s;
  if (out->crc32c() != crc || out->length() != data.size()) {
    return absl::DataLossError(
        absl::StrFormat("the server wrote %u bytes with CRC32C 0x%08x; sent %u bytes with 0x%08x",
                        out->length(), out->crc32c(), data.size(), crc));
  }
  return absl::OkStatus();
}

}  // namespace swirl::blockstore
