// The verification pattern of blockstore_load --verify (and of the tests).
//
// Every 4 KiB sector written carries a header naming where it belongs and which write produced
// it, a body derived deterministically from that, and a CRC32C over both:
//
//   bytes  0..7   magic "swirlblk"
//          8..15  the sector's byte offset in the volume
//         16..23  generation (which write of the run produced it; > 0)
//         24..31  run id (random per run of the load generator)
//         32..35  CRC32C of bytes 0..31 and 40..4095
//         36..39  zero
//         40..    body: 8-byte words, SplitMix64 of (run id, generation, offset, word)
//
// So a sector read back can be checked on its own (header, CRC: torn, misplaced or corrupted
// data) and, when the reader knows which generation it must hold, compared byte for byte
// against the regenerated pattern (stale data, lost writes).

#ifndef SWIRL_EXAMPLES_BLOCKSTORE_PATTERN_H_
#define SWIRL_EXAMPLES_BLOCKSTORE_PATTERN_H_

#include <cstdint>
#include <string>

namespace swirl::blockstore {

inline constexpr uint32_t kSectorSize = 4096;
inline constexpr uint64_t kPatternMagic = 0x6b6c626c72697773ull;  // "swirlblk" little-endian

// Fills `length` bytes (a multiple of 4096) meant for volume offset `offset`.
void FillPattern(char* out, uint64_t offset, uint32_t length, uint64_t generation, uint64_t run_id);

struct PatternCheck {
  uint32_t sectors = 0;
  uint32_t matched = 0;     // the expected generation of this run, byte for byte
  uint32_t consistent = 0;  // a valid pattern sector whose generation was not known in advance
  uint32_t zero = 0;        // all zeros (never written)
  uint32_t foreign = 0;     // not a pattern sector at all (written by something else)
  uint32_t bad = 0;         // wrong: corrupt, torn, misplaced, stale or lost
  std::string first_error;  // describes the first bad sector
  bool ok() const { return bad == 0; }
};

// Checks `length` bytes read at `offset`. With `expected_generation` > 0 every sector must be
// exactly what FillPattern(offset, expected_generation, run_id) wrote. With 0 (the block's
// contents are not known: never written in this run, or a write failed) zero sectors and
// foreign sectors are accepted, but any pattern sector must be intact and in its place.
PatternCheck CheckPattern(const char* data, uint64_t offset, uint32_t length, uint64_t run_id,
                          uint64_t expected_generation);

}  // namespace swirl::blockstore

#endif  // SWIRL_EXAMPLES_BLOCKSTORE_PATTERN_H_
