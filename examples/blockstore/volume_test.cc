// Unit tests of the blockstore's request checks, flag syntax, volumes (in memory and in files),
// CRC32C, the verification pattern and the latency histogram. No RPC here: blockstore_e2e_test
// runs the server.

#include "examples/blockstore/volume.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "examples/blockstore/checksum.h"
#include "examples/blockstore/histogram.h"
#include "examples/blockstore/pattern.h"
#include "gtest/gtest.h"

namespace swirl::blockstore {
namespace {

using absl::StatusCode;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

off_t FileSize(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

// ---- Request checks
// ------------------------------------------------------------------------------

TEST(ValidateIoTest, AcceptsAlignedRangesInsideTheVolume) {
  const uint64_t size = 64 << 20;
  EXPECT_TRUE(ValidateIo(size, 0, 4096).ok());
  EXPECT_TRUE(ValidateIo(size, 4096, 65536).ok());
  EXPECT_TRUE(ValidateIo(size, 0, 1 << 20).ok());
  EXPECT_TRUE(ValidateIo(size, size - 4096, 4096).ok());          // the last block
  EXPECT_TRUE(ValidateIo(size, size - (1 << 20), 1 << 20).ok());  // the last MiB
  EXPECT_TRUE(ValidateIo(4096, 0, 4096).ok());                    // a one-block volume
}

TEST(ValidateIoTest, RejectsBadLengthsAndOffsetsWithTheDocumentedCodes) {
  const uint64_t size = 64 << 20;
  struct Case {
    uint64_t offset, length;
    StatusCode code;
  };
  const Case cases[] = {
      {0, 0, StatusCode::kInvalidArgument},    // empty
      {0, 512, StatusCode::kInvalidArgument},  // below 4 KiB
      {0, 4095, StatusCode::kInvalidArgument},
      {0, 4096 + 512, StatusCode::kInvalidArgument},        // not a multiple
      {0, (1 << 20) + 4096, StatusCode::kInvalidArgument},  // above 1 MiB
      {0, 2 << 20, StatusCode::kInvalidArgument},
      {512, 4096, StatusCode::kInvalidArgument},  // unaligned offset
      {4095, 4096, StatusCode::kInvalidArgument},
      {size, 4096, StatusCode::kOutOfRange},         // starts at the end
      {size - 4096, 8192, StatusCode::kOutOfRange},  // runs past the end
      {size + (1 << 20), 4096, StatusCode::kOutOfRange},
      {UINT64_MAX - 4095, 4096, StatusCode::kOutOfRange},  // would overflow
      {(UINT64_MAX / 4096) * 4096, 1 << 20, StatusCode::kOutOfRange},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat("offset ", c.offset, " length ", c.length));
    EXPECT_EQ(ValidateIo(size, c.offset, c.length).code(), c.code);
  }
  // Alignment is judged before range: an unaligned request past the end is INVALID_ARGUMENT.
  EXPECT_EQ(ValidateIo(size, size + 1, 4096).code(), StatusCode::kInvalidArgument);
}

// ---- Flags
// -----------------------------------------------------------------------------------------

TEST(ParseSizeTest, NumbersAndBinarySuffixes) {
  struct Case {
    const char* text;
    uint64_t bytes;
  };
  const Case cases[] = {{"0", 0},           {"4096", 4096},  {"4k", 4096},     {"4K", 4096},
                        {"64k", 65536},     {"1m", 1 << 20}, {"1M", 1 << 20},  {"2g", 2ull << 30},
                        {"1t", 1ull << 40}, {"4KiB", 4096},  {"1MB", 1 << 20}, {"512b", 512},
                        {" 8k ", 8192}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    auto v = ParseSize(c.text);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(*v, c.bytes);
  }
  for (const char* bad :
       {"", "k", "-4k", "4x", "4kk", "1.5m", "abc", "99999999999999999999", "20000000t"}) {
    SCOPED_TRACE(bad);
    EXPECT_EQ(ParseSize(bad).status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(ParseSizeTest, FormatIsExactAndShort) {
  EXPECT_EQ(FormatSize(4096), "4k");
  EXPECT_EQ(FormatSize(1 << 20), "1m");
  EXPECT_EQ(FormatSize(3ull << 30), "3g");
  EXPECT_EQ(FormatSize(4096 + 512), "4608");
  EXPECT_EQ(FormatSize(1536 * 1024), "1536k");
  for (uint64_t v : {4096ull, 65536ull, 1ull << 20, 12345ull, 5ull << 40}) {
    EXPECT_EQ(*ParseSize(FormatSize(v)), v);
  }
}

TEST(VolumeSpecTest, ParsesNameSizeAndOptionalPath) {
  auto mem = ParseVolumeSpec("fast:64m");
  ASSERT_TRUE(mem.ok()) << mem.status();
  EXPECT_EQ(mem->name, "fast");
  EXPECT_EQ(mem->size, 64u << 20);
  EXPECT_TRUE(mem->path.empty());
  auto file = ParseVolumeSpec("disk-1.a_b:1g:/var/tmp/x:y.img");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->name, "disk-1.a_b");
  EXPECT_EQ(file->size, 1ull << 30);
  EXPECT_EQ(file->path, "/var/tmp/x:y.img");  // everything after the second ':'
}

TEST(VolumeSpecTest, RejectsMalformedSpecs) {
  for (const char* bad :
       {"", "novolume", ":64m", "a b:64m", "x/y:64m", "v:", "v:0", "v:4097", "v:1000", "v:lots",
        "v:64m:", "a123456789012345678901234567890123456789012345678901234567890123456:4k"}) {
    SCOPED_TRACE(bad);
    EXPECT_EQ(ParseVolumeSpec(bad).status().code(), StatusCode::kInvalidArgument);
  }
}

TEST(VolumeSpecTest, RepeatedAndCommaSeparatedFlagsAndDuplicates) {
  auto specs = ParseVolumeSpecs({"a:4k,b:8k:/tmp/b.img", "c:1m"});
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 3u);
  EXPECT_EQ((*specs)[0].name, "a");
  EXPECT_EQ((*specs)[1].path, "/tmp/b.img");
  EXPECT_EQ((*specs)[2].size, 1u << 20);
  EXPECT_EQ(ParseVolumeSpecs({"a:4k", "a:8k"}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseVolumeSpecs({"a:4k,,b:4k"})->size(), 2u);  // empty entries are skipped
}

// ---- Volumes
// ---------------------------------------------------------------------------------------

std::string Bytes(size_t n, uint8_t seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 31 + seed * 7 + (i >> 12)) & 0xff);
  return s;
}

void ExpectReadWriteRoundTrips(Volume& v) {
  std::string out(1 << 20, 'x');
  ASSERT_TRUE(v.Read(0, 4096, out.data()).ok());
  EXPECT_EQ(out.substr(0, 4096), std::string(4096, '\0')) << "a new volume reads as zeros";
  struct Io {
    uint64_t offset;
    uint32_t length;
  };
  const uint64_t last_mib = v.size() - (1 << 20);
  for (const Io& io : {Io{0, 4096}, Io{8192, 65536}, Io{(1 << 20) - 4096, 8192},  // straddles
                       Io{512 * 1024, 1 << 20}, Io{last_mib, 1 << 20}}) {
    SCOPED_TRACE(absl::StrCat(io.offset, "+", io.length));
    ASSERT_TRUE(ValidateIo(v.size(), io.offset, io.length).ok());
    const std::string data = Bytes(io.length, static_cast<uint8_t>(io.offset >> 12));
    ASSERT_TRUE(v.Write(io.offset, io.length, data.data()).ok());
    ASSERT_TRUE(v.Read(io.offset, io.length, out.data()).ok());
    EXPECT_TRUE(std::memcmp(out.data(), data.data(), io.length) == 0);
  }
  // Neighbours of a write are untouched.
  ASSERT_TRUE(v.Write(3 << 20, 4096, Bytes(4096, 1).data()).ok());
  ASSERT_TRUE(v.Read((3 << 20) - 4096, 4096 * 3, out.data()).ok());
  EXPECT_EQ(std::string(out.data(), 4096), std::string(4096, '\0'));
  EXPECT_EQ(std::string(out.data() + 4096, 4096), Bytes(4096, 1));
  EXPECT_EQ(std::string(out.data() + 8192, 4096), std::string(4096, '\0'));
}

TEST(VolumeTest, InMemoryVolumeRoundTrips) {
  auto v = Volume::Create({"mem", 8 << 20, ""});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_FALSE((*v)->file_backed());
  EXPECT_FALSE((*v)->blocking());
  EXPECT_EQ((*v)->size(), 8u << 20);
  ExpectReadWriteRoundTrips(**v);
  EXPECT_TRUE((*v)->Sync().ok());
}

TEST(VolumeTest, FileVolumeIsCreatedGrownAndPersists) {
  const std::string path = TempPath("file_volume.img");
  std::remove(path.c_str());
  {
    auto v = Volume::Create({"disk", 8 << 20, path});
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_TRUE((*v)->file_backed());
    EXPECT_TRUE((*v)->blocking());
    EXPECT_EQ(FileSize(path), 8 << 20) << "created and ftruncate'd to the volume size";
    ExpectReadWriteRoundTrips(**v);
    ASSERT_TRUE((*v)->Write(4 << 20, 4096, Bytes(4096, 9).data()).ok());
    EXPECT_TRUE((*v)->Sync().ok());
  }
  // Opened again (bigger): the data is still there, the file grew.
  auto v = Volume::Create({"disk", 16 << 20, path});
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(FileSize(path), 16 << 20);
  std::string out(4096, 'x');
  ASSERT_TRUE((*v)->Read(4 << 20, 4096, out.data()).ok());
  EXPECT_EQ(out, Bytes(4096, 9));
  ASSERT_TRUE((*v)->Read(12 << 20, 4096, out.data()).ok());
  EXPECT_EQ(out, std::string(4096, '\0'));
  v->reset();
  // Opened smaller: the file is never shrunk.
  auto small = Volume::Create({"disk", 4 << 20, path});
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ((*small)->size(), 4u << 20);
  EXPECT_EQ(FileSize(path), 16 << 20);
}

// A file cut short behind the server's back: the missing blocks are lost data, not zeros
// (which would pass for blocks never written).
TEST(VolumeTest, AFileTruncatedBehindTheServerReadsAsDataLoss) {
  const std::string path = TempPath("truncated.img");
  std::remove(path.c_str());
  auto v = Volume::Create({"disk", 1 << 20, path});
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_TRUE((*v)->Write(0, 8192, Bytes(8192, 5).data()).ok());
  ASSERT_EQ(truncate(path.c_str(), 4096), 0);
  std::string out(8192, 'x');
  EXPECT_TRUE((*v)->Read(0, 4096, out.data()).ok()) << "what is still there reads";
  EXPECT_EQ((*v)->Read(0, 8192, out.data()).code(), StatusCode::kDataLoss);
  EXPECT_EQ((*v)->Read(65536, 4096, out.data()).code(), StatusCode::kDataLoss);
}

TEST(VolumeTest, FileVolumeErrors) {
  const char* dir = std::getenv("TEST_TMPDIR");
  auto on_dir = Volume::Create({"d", 1 << 20, dir != nullptr ? dir : "/tmp"});
  EXPECT_FALSE(on_dir.ok());
  auto missing_dir = Volume::Create({"m", 1 << 20, TempPath("no/such/dir/x.img")});
  EXPECT_EQ(missing_dir.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(Volume::Create({"z", 1000, ""}).status().code(), StatusCode::kInvalidArgument);
}

// Concurrent writers of whole-range patterns and readers of the same range: every read sees one
// write entirely (the range straddles two 1 MiB extents, so both locks matter).
void ExpectNoTornReads(Volume& v) {
  constexpr uint64_t kOffset = 512 * 1024;
  constexpr uint32_t kLength = 1 << 20;
  std::atomic<bool> stop{false};
  std::atomic<int> torn{0};
  std::atomic<int> reads{0};
  std::vector<std::thread> threads;
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&, w] {
      std::string data(kLength, '\0');
      for (int i = 0; i < 150; ++i) {
        std::memset(data.data(), 1 + w * 100 + (i % 100), kLength);
        ASSERT_TRUE(v.Write(kOffset, kLength, data.data()).ok());
      }
    });
  }
  threads.emplace_back([&] {
    std::string out(kLength, '\0');
    while (!stop.load()) {
      ASSERT_TRUE(v.Read(kOffset, kLength, out.data()).ok());
      reads.fetch_add(1);
      const char first = out[0];
      for (uint32_t i = 0; i < kLength; i += 512) {
        if (out[i] != first) {
          torn.fetch_add(1);
          break;
        }
      }
    }
  });
  threads[0].join();
  threads[1].join();
  stop.store(true);
  threads[2].join();
  EXPECT_GT(reads.load(), 0);
  EXPECT_EQ(torn.load(), 0);
}

TEST(VolumeTest, ConcurrentReadsNeverSeeHalfAWriteInMemory) {
  auto v = Volume::Create({"mem", 4 << 20, ""});
  ASSERT_TRUE(v.ok());
  ExpectNoTornReads(**v);
}

TEST(VolumeTest, ConcurrentReadsNeverSeeHalfAWriteInAFile) {
  const std::string path = TempPath("torn.img");
  std::remove(path.c_str());
  auto v = Volume::Create({"disk", 4 << 20, path});
  ASSERT_TRUE(v.ok());
  ExpectNoTornReads(**v);
}

TEST(VolumeSetTest, FindsByNameAndRefusesDuplicates) {
  VolumeSet set;
  ASSERT_TRUE(set.Add({"a", 1 << 20, ""}).ok());
  ASSERT_TRUE(set.Add({"b", 2 << 20, ""}).ok());
  EXPECT_EQ(set.Add({"a", 1 << 20, ""}).code(), StatusCode::kAlreadyExists);
  ASSERT_NE(set.Find("b"), nullptr);
  EXPECT_EQ(set.Find("b")->size(), 2u << 20);
  EXPECT_EQ(set.Find("c"), nullptr);
  ASSERT_EQ(set.volumes().size(), 2u);
  EXPECT_EQ(set.volumes()[0]->name(), "a");
}

// ---- CRC32C
// ----------------------------------------------------------------------------------------

TEST(Crc32cTest, KnownVectors) {
  // RFC 3720 (iSCSI) B.4 and the classic check value.
  EXPECT_EQ(Crc32c("123456789", 9), 0xe3069283u);
  std::string zeros(32, '\0'), ones(32, '\xff'), inc(32, '\0');
  for (int i = 0; i < 32; ++i) inc[i] = static_cast<char>(i);
  EXPECT_EQ(Crc32c(zeros.data(), 32), 0x8a9136aau);
  EXPECT_EQ(Crc32c(ones.data(), 32), 0x62a8ab43u);
  EXPECT_EQ(Crc32c(inc.data(), 32), 0x46dd794eu);
  EXPECT_EQ(Crc32cPortable("123456789", 9), 0xe3069283u);
  EXPECT_EQ(Crc32cPortable(inc.data(), 32), 0x46dd794eu);
  EXPECT_EQ(Crc32c("", 0), 0u);
}

TEST(Crc32cTest, HardwareAndPortableAgreeAtAnyLengthAndAlignment) {
  absl::BitGen gen;
  std::string data(70000, '\0');
  for (char& c : data) c = static_cast<char>(absl::Uniform<uint8_t>(gen));
  for (size_t start : {0, 1, 3, 7, 8}) {
    for (size_t n : {0, 1, 7, 8, 9, 63, 4096, 65536}) {
      SCOPED_TRACE(absl::StrCat(start, "+", n));
      EXPECT_EQ(Crc32c(data.data() + start, n), Crc32cPortable(data.data() + start, n));
    }
  }
  // Chaining: crc(a ++ b) == crc(b) continued from crc(a).
  const uint32_t whole = Crc32c(data.data(), data.size());
  EXPECT_EQ(Crc32c(data.data() + 1000, data.size() - 1000, Crc32c(data.data(), 1000)), whole);
  // One flipped bit changes it.
  data[5000] ^= 0x10;
  EXPECT_NE(Crc32c(data.data(), data.size()), whole);
}

// ---- The verification pattern
// ---------------------------------------------------------------------

TEST(PatternTest, WrittenBlocksVerifyExactly) {
  std::string block(65536, '\0');
  FillPattern(block.data(), 1 << 20, 65536, 7, 0xabcdef);
  PatternCheck check = CheckPattern(block.data(), 1 << 20, 65536, 0xabcdef, 7);
  EXPECT_TRUE(check.ok()) << check.first_error;
  EXPECT_EQ(check.sectors, 16u);
  EXPECT_EQ(check.matched, 16u);
  // Unknown generation: still intact and in place.
  check = CheckPattern(block.data(), 1 << 20, 65536, 0xabcdef, 0);
  EXPECT_TRUE(check.ok());
  EXPECT_EQ(check.consistent, 16u);
  // Deterministic, and different per offset, generation and run.
  std::string again(65536, '\0');
  FillPattern(again.data(), 1 << 20, 65536, 7, 0xabcdef);
  EXPECT_EQ(again, block);
  FillPattern(again.data(), 1 << 20, 65536, 8, 0xabcdef);
  EXPECT_NE(again, block);
  FillPattern(again.data(), 1 << 20, 65536, 7, 0xabcdee);
  EXPECT_NE(again, block);
}

TEST(PatternTest, DetectsCorruptionStaleDataAndMisplacement) {
  std::string block(16384, '\0');
  FillPattern(block.data(), 81920, 16384, 3, 42);
  {
    std::string bad = block;
    bad[4096 + 1000] ^= 1;  // body of the second sector
    PatternCheck check = CheckPattern(bad.data(), 81920, 16384, 42, 3);
    EXPECT_EQ(check.bad, 1u);
    EXPECT_EQ(check.matched, 3u);
    EXPECT_NE(check.first_error.find("offset 86016"), std::string::npos) << check.first_error;
    // Even without knowing the generation, the sector CRC catches it.
    EXPECT_EQ(CheckPattern(bad.data(), 81920, 16384, 42, 0).bad, 1u);
  }
  {
    // Bytes 36..39 lie outside the CRC: checked on their own.
    std::string bad = block;
    bad[37] ^= 0x10;
    EXPECT_EQ(CheckPattern(bad.data(), 81920, 16384, 42, 3).bad, 1u);
    EXPECT_EQ(CheckPattern(bad.data(), 81920, 16384, 42, 0).bad, 1u);
  }
  // Stale: an older generation, intact.
  EXPECT_EQ(CheckPattern(block.data(), 81920, 16384, 42, 4).bad, 4u);
  // Another run's data where this run wrote.
  EXPECT_EQ(CheckPattern(block.data(), 81920, 16384, 43, 3).bad, 4u);
  // Misplaced: the right data read back for the wrong offset.
  EXPECT_EQ(CheckPattern(block.data(), 81920 + 4096, 16384, 42, 0).bad, 4u);
  // A torn block: two generations mixed.
  std::string torn = block;
  FillPattern(torn.data() + 8192, 81920 + 8192, 8192, 4, 42);
  PatternCheck check = CheckPattern(torn.data(), 81920, 16384, 42, 4);
  EXPECT_EQ(check.bad, 2u);
  EXPECT_EQ(check.matched, 2u);
}

TEST(PatternTest, ZerosAndForeignDataAreOnlyAcceptedWhenNothingIsExpected) {
  std::string zeros(8192, '\0');
  PatternCheck check = CheckPattern(zeros.data(), 0, 8192, 1, 0);
  EXPECT_TRUE(check.ok());
  EXPECT_EQ(check.zero, 2u);
  EXPECT_EQ(CheckPattern(zeros.data(), 0, 8192, 1, 5).bad, 2u);  // a lost write
  std::string text(8192, 'q');
  check = CheckPattern(text.data(), 0, 8192, 1, 0);
  EXPECT_TRUE(check.ok());
  EXPECT_EQ(check.foreign, 2u);
  EXPECT_EQ(CheckPattern(text.data(), 0, 8192, 1, 5).bad, 2u);
}

// ---- Histogram
// -------------------------------------------------------------------------------------

TEST(HistogramTest, PercentilesWithinOnePercent) {
  LatencyHistogram h;
  EXPECT_EQ(h.Percentile(0.5), 0u);
  for (uint64_t v = 1; v <= 100000; ++v) h.Add(v * 100);  // 100 ns .. 10 ms, uniform
  EXPECT_EQ(h.count(), 100000u);
  EXPECT_EQ(h.min(), 100u);
  EXPECT_EQ(h.max(), 10000000u);
  EXPECT_NEAR(h.mean(), 5000050.0, 1.0);
  for (double q : {0.5, 0.9, 0.99, 0.999}) {
    const double expected = q * 10000000.0;
    EXPECT_NEAR(static_cast<double>(h.Percentile(q)), expected, expected * 0.01) << q;
  }
  EXPECT_EQ(h.Percentile(1.0), 10000000u);
  LatencyHistogram small;
  for (uint64_t v : {3, 5, 7}) small.Add(v);
  EXPECT_EQ(small.Percentile(0.5), 5u);  // exact below 128 ns
  small.Merge(h);
  EXPECT_EQ(small.count(), 100003u);
  EXPECT_EQ(small.min(), 3u);
}

}  // namespace
}  // namespace swirl::blockstore
