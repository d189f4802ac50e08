// Volumes of the blockstore example: in-memory (anonymous memory) or file-backed (pread/pwrite),
// the request checks every Read and Write goes through, and the `--volume` flag syntax.

#ifndef SWIRL_EXAMPLES_BLOCKSTORE_VOLUME_H_
#define SWIRL_EXAMPLES_BLOCKSTORE_VOLUME_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace swirl::blockstore {

inline constexpr uint32_t kBlockSize = 4096;      // alignment of offsets and lengths
inline constexpr uint32_t kMaxIoSize = 1u << 20;  // largest length of one request

// "4096", "4k", "64K", "1m", "2g", "1t": bytes, the suffixes being powers of 1024 (an optional
// trailing "b"/"B"/"iB" is accepted: "4KiB", "1MB" = 1048576).
absl::StatusOr<uint64_t> ParseSize(absl::string_view text);

// Bytes as the shortest of "N", "Nk", "Nm", "Ng" that is exact.
std::string FormatSize(uint64_t bytes);

struct VolumeSpec {
  std::string name;
  uint64_t size = 0;
  std::string path;  // empty: in memory
};

// "name:size[:path]". Names are [A-Za-z0-9._-]{1,64}; the size a positive multiple of 4 KiB.
absl::StatusOr<VolumeSpec> ParseVolumeSpec(absl::string_view spec);
// Every value of every --volume flag, each a comma-separated list. Names must be unique.
absl::StatusOr<std::vector<VolumeSpec>> ParseVolumeSpecs(const std::vector<std::string>& values);

// The checks of blockstore.proto: INVALID_ARGUMENT for a length that is not a multiple of 4 KiB
// in [4 KiB, 1 MiB] or an offset that is not a multiple of 4 KiB; OUT_OF_RANGE for a range that
// does not lie inside the volume.
absl::Status ValidateIo(uint64_t volume_size, uint64_t offset, uint64_t length);

class Volume {
 public:
  struct Counters {
    std::atomic<uint64_t> reads{0};
    std::atomic<uint64_t> writes{0};
    std::atomic<uint64_t> bytes_read{0};
    std::atomic<uint64_t> bytes_written{0};
    std::atomic<uint64_t> errors{0};
  };

  // In memory (zero-filled, pages allocated on first touch) or, with spec.path, a file that is
  // created if missing and grown to spec.size if shorter (never shrunk).
  static absl::StatusOr<std::unique_ptr<Volume>> Create(const VolumeSpec& spec);
  ~Volume();
  Volume(const Volume&) = delete;
  Volume& operator=(const Volume&) = delete;

  const std::string& name() const { return name_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  bool file_backed() const { return fd_ >= 0; }
  // File I/O may block (page cache misses, writeback): such volumes are served on the handler
  // thread pool, never on a polling worker.
  bool blocking() const { return file_backed(); }

  // Copy [offset, offset + length) out of / into the volume. The range must have passed
  // ValidateIo. Thread-safe; each call is atomic with respect to the others (the 1 MiB extents
  // it touches are locked, shared for reads, exclusive for writes), so a read never returns half
  // of a concurrent write.
  absl::Status Read(uint64_t offset, uint32_t length, char* out);
  absl::Status Write(uint64_t offset, uint32_t length, const char* in);
  // fdatasync for a file (nothing to do in memory).
  absl::Status Sync();

  Counters& counters() { return counters_; }

 private:
  Volume() = default;
  class ExtentLock;
  static constexpr uint64_t kExtent = 1u << 20;

  std::string name_;
  uint64_t size_ = 0;
  std::string path_;
  int fd_ = -1;
  char* memory_ = nullptr;
  // pthread rwlocks underneath: visible to ThreadSanitizer (Debian's Abseil is not built
  // with its annotations).
  std::unique_ptr<std::shared_mutex[]> extents_;
  Counters counters_;
};

// The volumes of one server, by name. Immutable once built (lookups need no lock).
class VolumeSet {
 public:
  absl::Status Add(const VolumeSpec& spec);
  Volume* Find(absl::string_view name) const;
  const std::vector<Volume*>& volumes() const { return order_; }

 private:
  std::map<std::string, std::unique_ptr<Volume>, std::less<>> by_name_;
  std::vector<Volume*> order_;
};

}  // namespace swirl::blockstore

#endif  // SWIRL_EXAMPLES_BLOCKSTORE_VOLUME_H_
