#include "examples/blockstore/volume.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/log.h"

namespace swirl::blockstore {
namespace {

std::string ErrnoText(int err) { return std::strerror(err); }

bool ValidName(absl::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<uint64_t> ParseSize(absl::string_view text) {
  absl::string_view s = absl::StripAsciiWhitespace(text);
  const std::string original(s);
  // Optional "iB" / "B" unit after the multiplier ("4KiB", "1MB", "512B").
  if (absl::EndsWithIgnoreCase(s, "ib") && s.size() > 2) {
    s.remove_suffix(2);
  } else if (absl::EndsWithIgnoreCase(s, "b") && s.size() > 1) {
    s.remove_suffix(1);
  }
  uint64_t multiplier = 1;
  if (!s.empty()) {
    switch (absl::ascii_tolower(static_cast<unsigned char>(s.back()))) {
      case 'k':
        multiplier = 1ull << 10;
        break;
      case 'm':
        multiplier = 1ull << 20;
        break;
      case 'g':
        multiplier = 1ull << 30;
        break;
      case 't':
        multiplier = 1ull << 40;
        break;
      default:
        break;
    }
    if (multiplier != 1) s.remove_suffix(1);
  }
  uint64_t value = 0;
  if (s.empty() || !absl::SimpleAtoi(s, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", original, "' is not a size (e.g. 4096, 4k, 64k, 1m, 2g)"));
  }
  if (value > UINT64_MAX / multiplier) {
    return absl::InvalidArgumentError(absl::StrCat("size '", original, "' is too large"));
  }
  return value * multiplier;
}

std::string FormatSize(uint64_t bytes) {
  static constexpr struct {
    uint64_t unit;
    const char* suffix;
  } kUnits[] = {{1ull << 40, "t"}, {1ull << 30, "g"}, {1ull << 20, "m"}, {1ull << 10, "k"}};
  for (const auto& u : kUnits) {
    if (bytes >= u.unit && bytes % u.unit == 0) return absl::StrCat(bytes / u.unit, u.suffix);
  }
  return absl::StrCat(bytes);
}

absl::StatusOr<VolumeSpec> ParseVolumeSpec(absl::string_view spec) {
  // The path may itself contain ':' (everything after the second one is the path).
  std::vector<absl::string_view> parts = absl::StrSplit(spec, absl::MaxSplits(':', 2));
  if (parts.size() < 2) {
    return absl::InvalidArgumentError(absl::StrCat("volume '", spec, "' is not name:size[:path]"));
  }
  VolumeSpec out;
  out.name = std::string(parts[0]);
  if (!ValidName(out.name)) {
    return absl::InvalidArgumentError(
        absl::StrCat("volume name '", out.name, "' must be 1-64 of [A-Za-z0-9._-]"));
  }
  auto size = ParseSize(parts[1]);
  if (!size.ok()) return size.status();
  if (*size == 0 || *size % kBlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat("volume '", out.name, "': size ", *size,
                                                   " is not a positive multiple of ", kBlockSize));
  }
  out.size = *size;
  if (parts.size() == 3) {
    if (parts[2].empty()) {
      return absl::InvalidArgumentError(absl::StrCat("volume '", out.name, "': empty path"));
    }
    out.path = std::string(parts[2]);
  }
  return out;
}

absl::StatusOr<std::vector<VolumeSpec>> ParseVolumeSpecs(const std::vector<std::string>& values) {
  std::vector<VolumeSpec> out;
  for (const std::string& value : values) {
    for (absl::string_view one : absl::StrSplit(value, ',', absl::SkipWhitespace())) {
      auto spec = ParseVolumeSpec(absl::StripAsciiWhitespace(one));
      if (!spec.ok()) return spec.status();
      for (const VolumeSpec& seen : out) {
        if (seen.name == spec->name) {
          return absl::InvalidArgumentError(
              absl::StrCat("volume '", spec->name, "' is given twice"));
        }
      }
      out.push_back(std::move(*spec));
    }
  }
  return out;
}

absl::Status ValidateIo(uint64_t volume_size, uint64_t offset, uint64_t length) {
  if (length < kBlockSize || length > kMaxIoSize || length % kBlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrCat("length ", length, " is not a multiple of ",
                                                   kBlockSize, " between ", kBlockSize, " and ",
                                                   kMaxIoSize));
  }
  if (offset % kBlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("offset ", offset, " is not a multiple of ", kBlockSize));
  }
  if (offset >= volume_size || length > volume_size - offset) {
    return absl::OutOfRangeError(absl::StrCat("range [", offset, ", ", offset + length,
                                              ") is not inside the volume of ", volume_size,
                                              " bytes"));
  }
  return absl::OkStatus();
}

// ---- Volume ------------------------------------------------------------------------------------

// Locks the (one or two) extents a range touches, in ascending order.
class Volume::ExtentLock {
 public:
  ExtentLock(Volume* v, uint64_t offset, uint32_t length, bool exclusive)
      : v_(v),
        first_(offset / kExtent),
        last_((offset + length - 1) / kExtent),
        exclusive_(exclusive) {
    for (uint64_t e = first_; e <= last_; ++e) {
      if (exclusive_) {
        v_->extents_[e].lock();
      } else {
        v_->extents_[e].lock_shared();
      }
    }
  }
  ~ExtentLock() {
    for (uint64_t e = last_ + 1; e-- > first_;) {
      if (exclusive_) {
        v_->extents_[e].unlock();
      } else {
        v_->extents_[e].unlock_shared();
      }
    }
  }

 private:
  Volume* v_;
  uint64_t first_;
  uint64_t last_;
  bool exclusive_;
};

absl::StatusOr<std::unique_ptr<Volume>> Volume::Create(const VolumeSpec& spec) {
  if (spec.size == 0 || spec.size % kBlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("volume '", spec.name, "': size must be a positive multiple of 4096"));
  }
  std::unique_ptr<Volume> v(new Volume());
  v->name_ = spec.name;
  v->size_ = spec.size;
  v->path_ = spec.path;
  v->extents_.reset(new std::shared_mutex[(spec.size + kExtent - 1) / kExtent]);
  if (spec.path.empty()) {
    void* p = mmap(nullptr, spec.size, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("volume '", spec.name, "': cannot map ",
                                                       spec.size, " bytes: ", ErrnoText(errno)));
    }
    v->memory_ = static_cast<char*>(p);
    return v;
  }
  v->fd_ = open(spec.path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (v->fd_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("volume '", spec.name, "': open ", spec.path, ": ", ErrnoText(errno)));
  }
  struct stat st;
  if (fstat(v->fd_, &st) != 0) {
    return absl::InternalError(
        absl::StrCat("volume '", spec.name, "': fstat ", spec.path, ": ", ErrnoText(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("volume '", spec.name, "': ", spec.path, " is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) < spec.size &&
      ftruncate(v->fd_, static_cast<off_t>(spec.size)) != 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("volume '", spec.name, "': ftruncate ", spec.path, ": ", ErrnoText(errno)));
  }
  return v;
}

Volume::~Volume() {
  if (memory_ != nullptr) munmap(memory_, size_);
  if (fd_ >= 0) close(fd_);
}

absl::Status Volume::Read(uint64_t offset, uint32_t length, char* out) {
  ExtentLock lock(this, offset, length, /*exclusive=*/false);
  if (memory_ != nullptr) {
    std::memcpy(out, memory_ + offset, length);
    return absl::OkStatus();
  }
  size_t done = 0;
  while (done < length) {
    ssize_t n = pread(fd_, out + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::InternalError(absl::StrCat("pread ", path_, ": ", ErrnoText(errno)));
    }
    if (n == 0) {
      // The file was truncated behind our back: the data is gone, and zeros in its place
      // would pass for blocks never written.
      // The path stays in the server's log, not in what a client is told.
      SWIRL_LOG(ERROR, "%s ends at %u bytes, inside a %u-byte volume: truncated behind the server",
                path_, offset + done, size_);
      return absl::DataLossError(absl::StrFormat(
          "the volume's file ends at %u bytes, inside the volume: data lost", offset + done));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status Volume::Write(uint64_t offset, uint32_t length, const char* in) {
  ExtentLock lock(this, offset, length, /*exclusive=*/true);
  if (memory_ != nullptr) {
    std::memcpy(memory_ + offset, in, length);
    return absl::OkStatus();
  }
  size_t done = 0;
  while (done < length) {
    ssize_t n = pwrite(fd_, in + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      return err == ENOSPC
                 ? absl::ResourceExhaustedError(
                       absl::StrCat("pwrite ", path_, ": ", ErrnoText(err)))
                 : absl::InternalError(absl::StrCat("pwrite ", path_, ": ", ErrnoText(err)));
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status Volume::Sync() {
  if (fd_ < 0) return absl::OkStatus();
  if (fdatasync(fd_) != 0) {
    return absl::InternalError(absl::StrCat("fdatasync ", path_, ": ", ErrnoText(errno)));
  }
  return absl::OkStatus();
}

// ---- VolumeSet ---------------------------------------------------------------------------------

absl::Status VolumeSet::Add(const VolumeSpec& spec) {
  if (by_name_.count(spec.name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("volume '", spec.name, "' exists already"));
  }
  auto volume = Volume::Create(spec);
  if (!volume.ok()) return volume.status();
  order_.push_back(volume->get());
  by_name_.emplace(spec.name, std::move(*volume));
  return absl::OkStatus();
}

Volume* VolumeSet::Find(absl::string_view name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : it->second.get();
}

}  // namespace swirl::blockstore
