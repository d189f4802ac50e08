// CRC32C (Castagnoli, the iSCSI/ext4/NVMe polynomial), as carried in blockstore responses.
// Uses the SSE4.2 crc32 instruction when the CPU has it, slicing-by-8 tables otherwise; both
// give the same result (checksum_test compares them).

#ifndef SWIRL_EXAMPLES_BLOCKSTORE_CHECKSUM_H_
#define SWIRL_EXAMPLES_BLOCKSTORE_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

namespace swirl::blockstore {

// CRC32C of `size` bytes at `data`, continuing from `crc` (0 to start).
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

// The portable implementation, always available (for tests).
uint32_t Crc32cPortable(const void* data, size_t size, uint32_t crc = 0);

// True if Crc32c uses the CPU instruction.
bool Crc32cIsHardware();

}  // namespace swirl::blockstore

#endif  // SWIRL_EXAMPLES_BLOCKSTORE_CHECKSUM_H_
