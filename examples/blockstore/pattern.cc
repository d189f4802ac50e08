#include "examples/blockstore/pattern.h"

#include <cstring>

#include "absl/strings/str_format.h"
#include "examples/blockstore/checksum.h"

namespace swirl::blockstore {
namespace {

constexpr size_t kHeaderBytes = 40;
constexpr size_t kCrcOffset = 32;

inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t Load64(const char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

inline void Store64(char* p, uint64_t v) { std::memcpy(p, &v, 8); }

uint32_t SectorCrc(const char* sector) {
  uint32_t crc = Crc32c(sector, kCrcOffset);
  return Crc32c(sector + kHeaderBytes, kSectorSize - kHeaderBytes, crc);
}

uint64_t BodySeed(uint64_t offset, uint64_t generation, uint64_t run_id) {
  return SplitMix64(run_id ^ SplitMix64(generation ^ SplitMix64(offset)));
}

void FillSector(char* s, uint64_t offset, uint64_t generation, uint64_t run_id) {
  Store64(s, kPatternMagic);
  Store64(s + 8, offset);
  Store64(s + 16, generation);
  Store64(s + 24, run_id);
  Store64(s + 32, 0);
  const uint64_t seed = BodySeed(offset, generation, run_id);
  for (size_t i = kHeaderBytes; i < kSectorSize; i += 8) Store64(s + i, SplitMix64(seed + i));
  const uint32_t crc = SectorCrc(s);
  std::memcpy(s + kCrcOffset, &crc, 4);
}

bool AllZero(const char* p, size_t n) {
  for (size_t i = 0; i < n; i += 8) {
    if (Load64(p + i) != 0) return false;
  }
  return true;
}

}  // namespace

void FillPattern(char* out, uint64_t offset, uint32_t length, uint64_t generation,
                 uint64_t run_id) {
  for (uint32_t done = 0; done + kSectorSize <= length; done += kSectorSize) {
    FillSector(out + done, offset + done, generation, run_id);
  }
}

PatternCheck CheckPattern(const char* data, uint64_t offset, uint32_t length, uint64_t run_id,
                          uint64_t expected_generation) {
  PatternCheck r;
  auto bad = [&](uint64_t at, const std::string& why) {
    if (r.bad++ == 0) r.first_error = absl::StrFormat("sector at offset %u: %s", at, why);
  };
  for (uint32_t done = 0; done + kSectorSize <= length; done += kSectorSize) {
    ++r.sectors;
    const char* s = data + done;
    const uint64_t at = offset + done;
    if (Load64(s) != kPatternMagic) {
      if (expected_generation != 0) {
        bad(at, AllZero(s, kSectorSize) ? "zeros where a write of this run should be"
                                        : "not a pattern sector");
      } else if (AllZero(s, kSectorSize)) {
        ++r.zero;
      } else {
        ++r.foreign;
      }
      continue;
    }
    uint32_t stored_crc;
    std::memcpy(&stored_crc, s + kCrcOffset, 4);
    const uint32_t crc = SectorCrc(s);
    if (crc != stored_crc) {
      bad(at,
          absl::StrFormat("CRC32C 0x%08x, header says 0x%08x (corrupt or torn)", crc, stored_crc));
      continue;
    }
    uint32_t zero_word;
    std::memcpy(&zero_word, s + kCrcOffset + 4, 4);
    if (zero_word != 0) {  // bytes 36..39: outside the CRC, so checked here
      bad(at, absl::StrFormat("bytes 36..39 hold 0x%08x, not zero (corrupt)", zero_word));
      continue;
    }
    if (Load64(s + 8) != at) {
      bad(at, absl::StrFormat("holds the sector of offset %u (misplaced)", Load64(s + 8)));
      continue;
    }
    if (expected_generation == 0) {
      ++r.consistent;
      continue;
    }
    if (Load64(s + 24) != run_id || Load64(s + 16) != expected_generation) {
      bad(at, absl::StrFormat("generation %u of run %016x, expected generation %u of run %016x "
                              "(stale or lost write)",
                              Load64(s + 16), Load64(s + 24), expected_generation, run_id));
      continue;
    }
    // Byte for byte against the regenerated body.
    const uint64_t seed = BodySeed(at, expected_generation, run_id);
    bool same = true;
    for (size_t i = kHeaderBytes; i < kSectorSize && same; i += 8) {
      same = Load64(s + i) == SplitMix64(seed + i);
    }
    if (!same) {
      bad(at, "body differs from the pattern");
      continue;
    }
    ++r.matched;
  }
  return r;
}

}  // namespace swirl::blockstore
