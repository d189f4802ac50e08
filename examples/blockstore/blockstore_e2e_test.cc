// The blockstore end to end: blockstore_server in its own process with an in-memory and a
// file-backed volume, driven through the client library and the raw stub over separate
// connections in both bulk modes, then blockstore_cli and blockstore_load --verify as separate
// processes. Every wait is bounded; nothing sleeps to wait.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "examples/blockstore/blockstore.pb.h"
#include "examples/blockstore/blockstore.swirl.h"
#include "examples/blockstore/checksum.h"
#include "examples/blockstore/client.h"
#include "examples/blockstore/pattern.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "rpc/testing/process.h"
#include "swirl/channel.h"

extern char** environ;

namespace swirl::blockstore {
namespace {

constexpr char kServer[] = "examples/blockstore/blockstore_server";
constexpr char kCli[] = "examples/blockstore/blockstore_cli";
constexpr char kLoad[] = "examples/blockstore/blockstore_load";
constexpr char kToken[] = "blockstore-e2e";
constexpr uint64_t kMemSize = 32 << 20;
constexpr uint64_t kDiskSize = 8 << 20;

using absl::StatusCode;

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary) << data;
}

std::string Bytes(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 29 + (i >> 9)) & 0xff);
  return s;
}

// Runs a binary to completion with stdout in `stdout_path` (or inherited if empty). Returns the
// exit code (128 + signal if killed), or -1 if it did not finish within `timeout` (then it is
// killed, and the test fails). Waits on a pidfd where the kernel has them.
int RunBinary(const std::vector<std::string>& args, const std::string& stdout_path,
              absl::Duration timeout) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (!stdout_path.empty()) {
    posix_spawn_file_actions_addopen(&actions, 1, stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC,
                                     0644);
  }
  pid_t pid;
  const int err = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (err != 0) {
    ADD_FAILURE() << "posix_spawn " << args[0] << ": " << std::strerror(err);
    return -1;
  }
  int status = 0;
  bool exited = false;
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    int r;
    do {
      r = poll(&p, 1, static_cast<int>(absl::ToInt64Milliseconds(timeout)));
    } while (r < 0 && errno == EINTR);
    exited = r > 0;
    close(pidfd);
    if (exited) waitpid(pid, &status, 0);
  } else {
    // No pidfd (an older kernel, a seccomp filter): poll the child, still within the timeout.
    const absl::Time deadline = absl::Now() + timeout;
    while (!exited && absl::Now() < deadline) {
      exited = waitpid(pid, &status, WNOHANG) == pid;
      if (!exited) absl::SleepFor(absl::Milliseconds(5));
    }
  }
  if (!exited) {
    ADD_FAILURE() << args[0] << " did not exit within " << absl::FormatDuration(timeout);
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

ChannelOptions Options(BulkMode mode, bool local_only = false) {
  ChannelOptions options;
  options.auth_token = kToken;
  options.client_name = "blockstore_e2e_test";
  options.driver = ChannelOptions::Driver::kCaller;  // no polling thread of our own
  options.bulk_mode = mode;
  if (local_only) options.transport.invalidation = InvalidationPolicy::kLocalOnly;
  return options;
}

CallOptions Bounded() {
  CallOptions options;
  options.timeout = absl::Seconds(10);
  return options;
}

class BlockstoreE2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    disk_path_ = new std::string(TempPath("disk.img"));
    std::remove(disk_path_->c_str());
    auto server = testing::SpawnServer(
        kServer, {"--address=127.0.0.1:0", absl::StrCat("--token=", kToken), "--cores=1",
                  "--volume=mem:32m", "--volume", absl::StrCat("disk:8m:", *disk_path_)});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = new testing::ChildProcess(std::move(server->first));
    address_ = new std::string(absl::StrCat("127.0.0.1:", server->second));
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr) {
      // A graceful shutdown ends with exit code 0.
      server_->Signal(SIGTERM);
      auto rc = server_->Wait(absl::Seconds(15));
      EXPECT_TRUE(rc.ok()) << rc.status();
      if (rc.ok()) {
        EXPECT_EQ(*rc, 0);
      }
    }
    delete server_;
    delete address_;
    delete disk_path_;
    server_ = nullptr;
  }

  void SetUp() override {
    if (server_ == nullptr) GTEST_SKIP() << "the server did not start";
  }

  static std::unique_ptr<BlockStoreClient> Connect(BulkMode mode, bool local_only = false) {
    auto client = BlockStoreClient::Connect(*address_, Options(mode, local_only));
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  }

  static testing::ChildProcess* server_;
  static std::string* address_;
  static std::string* disk_path_;
};
testing::ChildProcess* BlockstoreE2ETest::server_ = nullptr;
std::string* BlockstoreE2ETest::address_ = nullptr;
std::string* BlockstoreE2ETest::disk_path_ = nullptr;

TEST_F(BlockstoreE2ETest, ListsVolumesWithTheirBackingAndExecution) {
  auto client = Connect(BulkMode::kServerExposes);
  ASSERT_NE(client, nullptr);
  auto volumes = client->ListVolumes(Bounded());
  ASSERT_TRUE(volumes.ok()) << volumes.status();
  ASSERT_EQ(volumes->size(), 2u);
  const VolumeInfo& mem = (*volumes)[0];
  EXPECT_EQ(mem.name(), "mem");
  EXPECT_EQ(mem.size(), kMemSize);
  EXPECT_EQ(mem.backing(), BACKING_MEMORY);
  EXPECT_FALSE(mem.blocking());
  EXPECT_EQ(mem.block_size(), 4096u);
  EXPECT_EQ(mem.max_io_size(), 1u << 20);
  const VolumeInfo& disk = (*volumes)[1];
  EXPECT_EQ(disk.name(), "disk");
  EXPECT_EQ(disk.size(), kDiskSize);
  EXPECT_EQ(disk.backing(), BACKING_FILE);
  EXPECT_TRUE(disk.blocking());
  EXPECT_EQ(disk.path(), *disk_path_);
  auto stat = client->Stat("disk", Bounded());
  ASSERT_TRUE(stat.ok()) << stat.status();
  EXPECT_EQ(stat->size(), kDiskSize);
  EXPECT_EQ(client->Stat("nope", Bounded()).status().code(), StatusCode::kNotFound);
  // The backing file exists at the volume's size.
  EXPECT_EQ(ReadFile(*disk_path_).size(), kDiskSize);
}

// Data written over one connection is read back, byte for byte, over another, for 4 KiB,
// 64 KiB and 1 MiB, both volumes, and writer and reader in different bulk modes.
TEST_F(BlockstoreE2ETest, WritesAreReadBackByAnotherConnection) {
  struct Pair {
    BulkMode writer, reader;
  };
  int seed = 0;
  for (const Pair& pair : {Pair{BulkMode::kServerExposes, BulkMode::kMirror},
                           Pair{BulkMode::kMirror, BulkMode::kServerExposes}}) {
    auto writer = Connect(pair.writer);
    auto reader = Connect(pair.reader);
    ASSERT_NE(writer, nullptr);
    ASSERT_NE(reader, nullptr);
    ASSERT_NE(writer->channel().connection_id(), reader->channel().connection_id());
    auto out = writer->AllocateBuffer(1 << 20);
    auto in = reader->AllocateBuffer(1 << 20);
    ASSERT_TRUE(out.ok() && in.ok());
    for (const char* volume : {"mem", "disk"}) {
      for (uint32_t length : {4096u, 65536u, 1u << 20}) {
        ++seed;
        SCOPED_TRACE(absl::StrCat(volume, " ", length, " bytes, writer ", BulkModeName(pair.writer),
                                  ", reader ", BulkModeName(pair.reader)));
        // Offsets not aligned to the length, so 1 MiB straddles two extents.
        const uint64_t offset = (1 << 20) + static_cast<uint64_t>(seed) * 12288;
        const std::string data = Bytes(length, seed);
        // What lies just beyond the range, before the write.
        absl::Status s = reader->Read(volume, offset + length, 4096, &*in, nullptr, Bounded());
        ASSERT_TRUE(s.ok()) << s;
        const std::string beyond(in->view());
        std::memcpy(out->data(), data.data(), length);
        out->resize(length);
        WriteResponse written;
        s = writer->Write(volume, offset, *out, &written, Bounded());
        ASSERT_TRUE(s.ok()) << s;
        EXPECT_EQ(written.length(), length);
        EXPECT_EQ(written.crc32c(), Crc32c(data.data(), length));

        std::memset(in->data(), 0xee, in->capacity());
        ReadResponse read;
        s = reader->Read(volume, offset, length, &*in, &read, Bounded());
        ASSERT_TRUE(s.ok()) << s;
        ASSERT_EQ(in->size(), length);
        EXPECT_TRUE(in->view() == data) << "data read back differs";
        EXPECT_EQ(read.crc32c(), written.crc32c());
        // Nothing beyond the range was written.
        s = reader->Read(volume, offset + length, 4096, &*in, nullptr, Bounded());
        ASSERT_TRUE(s.ok()) << s;
        EXPECT_TRUE(in->view() == beyond) << "the write changed the next 4 KiB";
      }
    }
    EXPECT_EQ(writer->channel().LocalStats().invalidation_violations, 0u);
    EXPECT_EQ(reader->channel().LocalStats().invalidation_violations, 0u);
  }
  // The file holds what was written through the server (fdatasync is only at shutdown, but
  // pwrite has put it in the page cache every reader of the file sees).
  const std::string file = ReadFile(*disk_path_);
  const uint64_t offset = (1 << 20) + 4 * 12288;  // seed 4: "disk", 4096 bytes, first pair
  ASSERT_GE(file.size(), offset + 4096);
  EXPECT_TRUE(file.substr(offset, 4096) == Bytes(4096, 4));
}

// The raw stub, with the request checks' status codes.
TEST_F(BlockstoreE2ETest, BadRequestsAreRejectedWithTheRightCodes) {
  auto client = Connect(BulkMode::kServerExposes);
  ASSERT_NE(client, nullptr);
  BlockStoreStub& stub = client->stub();
  auto buffer = client->AllocateBuffer(1 << 20);
  ASSERT_TRUE(buffer.ok());
  auto read = [&](const std::string& volume, uint64_t offset, uint32_t length, bool blocking) {
    ReadRequest request;
    request.set_volume(volume);
    request.set_offset(offset);
    request.set_length(length);
    ReadResponse response;
    CallOptions options = Bounded();
    options.response_bulk = &*buffer;
    return blocking ? stub.ReadBlocking(request, &response, options)
                    : stub.Read(request, &response, options);
  };
  struct Case {
    const char* volume;
    uint64_t offset;
    uint32_t length;
    StatusCode code;
  };
  const Case cases[] = {
      {"mem", 4096 + 512, 4096, StatusCode::kInvalidArgument},  // unaligned offset
      {"mem", 0, 1000, StatusCode::kInvalidArgument},           // unaligned length
      {"mem", 0, 0, StatusCode::kInvalidArgument},              // empty
      {"mem", 0, 2 << 20, StatusCode::kInvalidArgument},        // above 1 MiB
      {"mem", kMemSize, 4096, StatusCode::kOutOfRange},         // at the end
      {"mem", kMemSize - 4096, 8192, StatusCode::kOutOfRange},  // past the end
      {"mem", 1ull << 62, 4096, StatusCode::kOutOfRange},
      {"disk", kDiskSize - 4096, 65536, StatusCode::kOutOfRange},
      {"disk", 12288 + 1, 4096, StatusCode::kInvalidArgument},
      {"nope", 0, 4096, StatusCode::kNotFound},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(c.volume, " offset ", c.offset, " length ", c.length));
    const bool blocking = std::string(c.volume) == "disk";
    EXPECT_EQ(read(c.volume, c.offset, c.length, blocking).code(), c.code);
    // The same through the client library (which picks the method itself).
    EXPECT_EQ(client->Read(c.volume, c.offset, c.length, &*buffer, nullptr, Bounded()).code(),
              c.length > (1u << 20) ? StatusCode::kInvalidArgument : c.code);
  }
  // The worker methods refuse a file-backed volume instead of blocking a polling thread.
  absl::Status s = read("disk", 0, 4096, /*blocking=*/false);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("ReadBlocking"), absl::string_view::npos) << s;
  // ...and the blocking methods refuse an in-memory volume, whose locks only workers take (a
  // pool thread holding one would stall the worker waiting for it).
  s = read("mem", 0, 4096, /*blocking=*/true);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("use Read"), absl::string_view::npos) << s;

  // Writes: the data must come as a bulk attachment of exactly `length` bytes.
  WriteRequest request;
  request.set_volume("mem");
  request.set_offset(65536);
  request.set_length(8192);
  WriteResponse response;
  s = stub.Write(request, &response, Bounded());
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  const std::string before = Bytes(8192, 77);
  std::memcpy(buffer->data(), before.data(), before.size());
  buffer->resize(8192);
  ASSERT_TRUE(client->Write("mem", 65536, *buffer, nullptr, Bounded()).ok());
  buffer->resize(4096);
  CallOptions with_data = Bounded();
  with_data.request_bulk = &*buffer;
  s = stub.Write(request, &response, with_data);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  // A checksum that does not match the data arriving: DATA_LOSS, and nothing is written.
  buffer->resize(8192);
  std::memset(buffer->data(), 0x5a, 8192);
  request.set_has_crc32c(true);
  request.set_crc32c(Crc32c(before.data(), 8192));
  s = stub.Write(request, &response, with_data);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s;
  request.set_offset(kMemSize);
  EXPECT_EQ(stub.Write(request, &response, with_data).code(), StatusCode::kOutOfRange);
  request.set_volume("disk");
  request.set_offset(0);
  EXPECT_EQ(stub.Write(request, &response, with_data).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(client->Read("mem", 65536, 8192, &*buffer, nullptr, Bounded()).ok());
  EXPECT_TRUE(buffer->view() == before) << "a refused write changed the volume";

  // Refusals are counted, and the server keeps serving.
  auto mem = client->Stat("mem", Bounded());
  ASSERT_TRUE(mem.ok());
  EXPECT_GE(mem->errors(), 10u);
  EXPECT_EQ(client->channel().LocalStats().invalidation_violations, 0u);
  EXPECT_TRUE(client->channel().connected());
}

TEST_F(BlockstoreE2ETest, CliWritesReadsAndExitCodes) {
  const std::string server = "--server=" + *address_;
  const std::string token = absl::StrCat("--token=", kToken);
  const std::string input = TempPath("cli_in");
  const std::string output = TempPath("cli_out");
  const std::string data = Bytes(3 * (1 << 20) + 8192, 5);  // 4 requests: split at 1 MiB
  WriteFile(input, data);
  const absl::Duration timeout = absl::Seconds(20);
  for (const char* volume : {"mem", "disk"}) {
    SCOPED_TRACE(volume);
    const std::string vol = absl::StrCat("--volume=", volume);
    EXPECT_EQ(RunBinary({kCli, server, token, "write", vol, "--offset=1m", "--input=" + input}, "",
                        timeout),
              0);
    EXPECT_EQ(RunBinary({kCli, server, token, "read", vol, "--offset=1m",
                         absl::StrCat("--length=", data.size()), "--output=" + output,
                         "--bulk_mode=mirror"},
                        "", timeout),
              0);
    EXPECT_TRUE(ReadFile(output) == data);
  }
  EXPECT_EQ(RunBinary({kCli, server, token, "stat"}, output, timeout), 0);
  EXPECT_NE(ReadFile(output).find("disk"), std::string::npos);
  // 5: refused (out of range, unaligned); 4: no such volume; 3: cannot connect (bad token);
  // 2: usage (input not a multiple of 4 KiB without --pad, unknown subcommand).
  EXPECT_EQ(RunBinary({kCli, server, token, "read", "--volume=mem", "--offset=32m", "--length=4k",
                       "--output=" + output},
                      "", timeout),
            5);
  EXPECT_EQ(RunBinary({kCli, server, token, "read", "--volume=mem", "--offset=1000",
                       "--output=" + output},
                      "", timeout),
            5);
  EXPECT_EQ(RunBinary({kCli, server, token, "stat", "--volume=nope"}, "", timeout), 4);
  EXPECT_EQ(RunBinary({kCli, server, "--token=wrong", "stat"}, "", timeout), 3);
  WriteFile(input, "not a block");
  EXPECT_EQ(
      RunBinary({kCli, server, token, "write", "--volume=mem", "--input=" + input}, "", timeout),
      2);
  EXPECT_EQ(RunBinary({kCli, server, token, "write", "--volume=mem", "--offset=8m", "--pad",
                       "--input=" + input},
                      "", timeout),
            0);
  EXPECT_EQ(RunBinary({kCli, server, token, "frobnicate"}, "", timeout), 2);
  // Input that cannot be read (a directory) is an error before anything is written, not an
  // empty or short write; a read length that is no whole number of blocks is refused up front.
  const char* tmp = std::getenv("TEST_TMPDIR");
  EXPECT_EQ(RunBinary({kCli, server, token, "write", "--volume=mem",
                       absl::StrCat("--input=", tmp != nullptr ? tmp : "/tmp")},
                      "", timeout),
            2);
  EXPECT_EQ(RunBinary({kCli, server, token, "read", "--volume=mem", "--length=6k",
                       "--output=" + output},
                      "", timeout),
            2);
}

// blockstore_load --verify, in both bulk modes, both volumes, with and without the local
// invalidation fallback: exits 0 and reports no errors, no verify failures, and reads that
// were checked against what this run wrote.
TEST_F(BlockstoreE2ETest, LoadGeneratorVerifiesInBothBulkModes) {
  struct LoadRun {
    const char* volume;
    const char* bulk_mode;
    const char* bs;
    bool local_only;
    int iodepth;
  };
  // First a run without --verify over the same region: what it leaves behind must not trip the
  // verifying runs (it is neither this run's pattern nor a misplaced one).
  ASSERT_EQ(RunBinary({kLoad, "--server=" + *address_, absl::StrCat("--token=", kToken),
                       "--volume=mem", "--rw=randwrite", "--bs=64k", "--iodepth=4", "--size=2m",
                       "--number_ios=500", "--core=0"},
                      TempPath("load0.txt"), absl::Seconds(30)),
            0);
  EXPECT_NE(ReadFile(TempPath("load0.txt")).find("errors=0 verify_failures=0"), std::string::npos);
  int n = 0;
  // iodepth 16 exceeds the 8 upload window credits: the writes beyond them wait inside swirl.
  for (const LoadRun& r : {LoadRun{"mem", "server-exposes", "4k", false, 16},
                           LoadRun{"mem", "mirror", "64k", false, 8},
                           LoadRun{"disk", "server-exposes", "64k", true, 8},
                           LoadRun{"disk", "mirror", "4k", true, 16}}) {
    SCOPED_TRACE(absl::StrCat(r.volume, " ", r.bulk_mode, " bs=", r.bs, " iodepth=", r.iodepth,
                              r.local_only ? " local invalidation" : ""));
    if (n == 1) {
      // Between two verifying runs over "mem", one that reads and writes without verifying:
      // what it writes must not be blocks it read (the first run's pattern, which the next
      // would take for misplaced data).
      ASSERT_EQ(RunBinary({kLoad, "--server=" + *address_, absl::StrCat("--token=", kToken),
                           "--volume=mem", "--rw=randrw", "--bs=4k", "--iodepth=8", "--size=2m",
                           "--number_ios=4000", "--core=0"},
                          TempPath("load_between.txt"), absl::Seconds(30)),
                0);
    }
    const std::string json_path = TempPath(absl::StrCat("load", ++n, ".json"));
    std::vector<std::string> args = {kLoad,
                                     "--server=" + *address_,
                                     absl::StrCat("--token=", kToken),
                                     absl::StrCat("--volume=", r.volume),
                                     "--rw=randrw",
                                     "--rwmixread=50",
                                     absl::StrCat("--bs=", r.bs),
                                     absl::StrCat("--iodepth=", r.iodepth),
                                     "--size=2m",
                                     "--number_ios=20000",
                                     "--runtime=2",
                                     "--verify",
                                     absl::StrCat("--bulk_mode=", r.bulk_mode),
                                     "--core=0",
                                     "--json"};
    if (r.local_only) args.push_back("--local_invalidation_only");
    ASSERT_EQ(RunBinary(args, json_path, absl::Seconds(30)), 0);
    const std::string json = ReadFile(json_path);
    google::protobuf::Struct report;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &report).ok()) << json;
    static const google::protobuf::Value kMissing;
    // Struct's map is read through reflection, i.e. by libprotobuf itself, not with fields():
    // under --config=tsan protobuf's headers give every map field two more members
    // (map_field.h), which the uninstrumented libprotobuf that filled the map does not have.
    auto field = [&](const google::protobuf::Struct& s,
                     const std::string& name) -> const google::protobuf::Value& {
      const google::protobuf::Reflection* reflection = s.GetReflection();
      const google::protobuf::FieldDescriptor* fields =
          s.GetDescriptor()->FindFieldByName("fields");
      for (int i = 0; i < reflection->FieldSize(s, fields); ++i) {
        const google::protobuf::Message& entry = reflection->GetRepeatedMessage(s, fields, i);
        const google::protobuf::Descriptor* type = entry.GetDescriptor();
        if (entry.GetReflection()->GetString(entry, type->map_key()) == name) {
          return static_cast<const google::protobuf::Value&>(
              entry.GetReflection()->GetMessage(entry, type->map_value()));
        }
      }
      ADD_FAILURE() << name << " missing in " << json;
      return kMissing;
    };
    auto number = [&](const google::protobuf::Struct& s, const std::string& name) {
      return field(s, name).number_value();
    };
    EXPECT_EQ(number(report, "errors"), 0) << json;
    EXPECT_EQ(number(report, "verify_failures"), 0) << json;
    EXPECT_GT(number(report, "verified_reads"), 0) << json;
    const auto& read = field(report, "read").struct_value();
    const auto& write = field(report, "write").struct_value();
    const auto& total = field(report, "total").struct_value();
    EXPECT_GT(number(read, "ios"), 0);
    EXPECT_GT(number(write, "ios"), 0);
    EXPECT_EQ(number(total, "ios"), number(read, "ios") + number(write, "ios"));
    EXPECT_LE(number(total, "ios"), 20000);
    EXPECT_GT(number(total, "iops"), 0);
    const auto& lat = field(total, "lat_us").struct_value();
    EXPECT_LE(number(lat, "p50"), number(lat, "p99"));
    EXPECT_LE(number(lat, "p99"), number(lat, "max"));
    const auto& channel = field(report, "channel").struct_value();
    EXPECT_EQ(field(channel, "invalidation").string_value(),
              r.local_only ? "INVALIDATION_LOCAL" : "INVALIDATION_REMOTE");
    EXPECT_EQ(field(channel, "bulk_mode").string_value(),
              std::string(r.bulk_mode) == "mirror" ? "BULK_MIRROR" : "BULK_SERVER_EXPOSES");
    // Every bulk transfer's window was revoked, the way the negotiated mode says.
    const auto& mine = field(report, "client_windows").struct_value();
    const auto& theirs = field(report, "server_windows").struct_value();
    EXPECT_EQ(number(mine, "invalidation_violations"), 0);
    EXPECT_EQ(number(theirs, "invalidation_violations"), 0);
    const double remote = number(mine, "remote_invalidated") + number(theirs, "remote_invalidated");
    const double local =
        number(mine, "locally_invalidated") + number(theirs, "locally_invalidated");
    if (r.local_only) {
      EXPECT_EQ(remote, 0);
      EXPECT_GE(local, number(total, "ios"));
    } else {
      EXPECT_EQ(local, 0);
      EXPECT_GE(remote, number(total, "ios"));
    }
  }
}

// A file-backed volume keeps its data across a graceful restart of the server.
// Listening beyond loopback with no token would let anyone read and write every volume: the
// server refuses to start that way unless told --insecure.
TEST(BlockstoreServerFlags, RefusesToListenBeyondLoopbackWithoutAToken) {
  EXPECT_EQ(RunBinary({kServer, "--address=0.0.0.0:0", "--volume=a:1m"}, "", absl::Seconds(30)),
            2);
}

// Tenants: alice owns volume "a" and bob volume "b" (--principals_file, --owner), "shared" has
// no owner. The attacker is alice, with her own token, going for bob's volume through every
// method (the raw stub, so that each handler itself is asked, in memory and in a file), and
// through blockstore_cli in its own process.
TEST(BlockstoreTenants, AVolumeIsRefusedToEveryPrincipalButItsOwner) {
  const std::string principals = TempPath("principals");
  WriteFile(principals, "# tenants\nalice token=alice-token\nbob   token=bob-token  # b\n");
  const std::string disk = TempPath("bob_disk.img");
  std::remove(disk.c_str());
  auto server = testing::SpawnServer(
      kServer, {"--address=127.0.0.1:0", "--principals_file=" + principals, "--cores=1",
                "--volume=a:1m,b:1m,shared:1m", "--volume", "bdisk:1m:" + disk,
                "--owner=a=alice,b=bob", "--owner=bdisk=bob"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = absl::StrCat("127.0.0.1:", server->second);
  auto as = [&](const std::string& token) {
    ChannelOptions options = Options(BulkMode::kServerExposes);
    options.auth_token = token;
    auto client = BlockStoreClient::Connect(address, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? std::move(*client) : nullptr;
  };
  auto alice = as("alice-token");
  auto bob = as("bob-token");
  ASSERT_NE(alice, nullptr);
  ASSERT_NE(bob, nullptr);

  // bob's data, which alice must neither read nor change.
  const std::string secret = Bytes(8192, 17);
  auto bobs = bob->AllocateBuffer(8192);
  ASSERT_TRUE(bobs.ok());
  for (const char* volume : {"b", "bdisk"}) {
    std::memcpy(bobs->data(), secret.data(), secret.size());
    bobs->resize(secret.size());
    ASSERT_TRUE(bob->Write(volume, 0, *bobs, nullptr, Bounded()).ok()) << volume;
  }

  auto buffer = alice->AllocateBuffer(8192);
  ASSERT_TRUE(buffer.ok());
  BlockStoreStub& stub = alice->stub();
  for (const char* volume : {"b", "bdisk"}) {
    SCOPED_TRACE(volume);
    ReadRequest read;
    read.set_volume(volume);
    read.set_offset(0);
    read.set_length(8192);
    ReadResponse read_response;
    CallOptions into = Bounded();
    into.response_bulk = &*buffer;
    EXPECT_EQ(stub.Read(read, &read_response, into).code(), StatusCode::kPermissionDenied);
    EXPECT_EQ(stub.ReadBlocking(read, &read_response, into).code(),
              StatusCode::kPermissionDenied);
    std::memset(buffer->data(), 0x5a, 8192);
    buffer->resize(8192);
    WriteRequest write;
    write.set_volume(volume);
    write.set_offset(0);
    write.set_length(8192);
    WriteResponse write_response;
    CallOptions from = Bounded();
    from.request_bulk = &*buffer;
    EXPECT_EQ(stub.Write(write, &write_response, from).code(), StatusCode::kPermissionDenied);
    EXPECT_EQ(stub.WriteBlocking(write, &write_response, from).code(),
              StatusCode::kPermissionDenied);
    EXPECT_EQ(alice->Stat(volume, Bounded()).status().code(), StatusCode::kPermissionDenied);
  }
  // She is not shown bob's volumes; hers and the shared one she uses.
  auto listed = alice->ListVolumes(Bounded());
  ASSERT_TRUE(listed.ok()) << listed.status();
  std::vector<std::string> names;
  for (const VolumeInfo& v : *listed) names.push_back(v.name());
  EXPECT_EQ(names, (std::vector<std::string>{"a", "shared"}));
  for (const char* volume : {"a", "shared"}) {
    std::memset(buffer->data(), 0x5a, 8192);
    buffer->resize(8192);
    EXPECT_TRUE(alice->Write(volume, 0, *buffer, nullptr, Bounded()).ok()) << volume;
    EXPECT_TRUE(alice->Read(volume, 0, 8192, &*buffer, nullptr, Bounded()).ok()) << volume;
  }
  // bob is refused alice's volume the same way.
  EXPECT_EQ(bob->Stat("a", Bounded()).status().code(), StatusCode::kPermissionDenied);

  // blockstore_cli as alice, a process of its own: exit 7 (PERMISSION_DENIED) for bob's volume.
  const std::string output = TempPath("tenant_out");
  const std::string input = TempPath("tenant_in");
  WriteFile(input, std::string(4096, 'x'));
  const absl::Duration timeout = absl::Seconds(20);
  const std::string server_flag = "--server=" + address;
  EXPECT_EQ(RunBinary({kCli, server_flag, "--token=alice-token", "read", "--volume=b",
                       "--length=4k", "--output=" + output},
                      "", timeout),
            7);
  EXPECT_EQ(RunBinary({kCli, server_flag, "--token=alice-token", "write", "--volume=b",
                       "--input=" + input},
                      "", timeout),
            7);
  EXPECT_EQ(RunBinary({kCli, server_flag, "--token=alice-token", "write", "--volume=a",
                       "--input=" + input},
                      "", timeout),
            0);

  // And bob's data is as he wrote it.
  for (const char* volume : {"b", "bdisk"}) {
    ASSERT_TRUE(bob->Read(volume, 0, 8192, &*bobs, nullptr, Bounded()).ok()) << volume;
    EXPECT_TRUE(bobs->view() == secret) << volume << " changed";
  }
  alice.reset();
  bob.reset();
  server->first.Signal(SIGTERM);
  auto rc = server->first.Wait(absl::Seconds(15));
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(*rc, 0);
}

// A volume's owner must be a principal the server has, and the volume one it serves.
TEST(BlockstoreServerFlags, RefusesAnOwnerThatIsNoPrincipalOrNoVolume) {
  const std::string principals = TempPath("principals_flags");
  WriteFile(principals, "alice token=alice-token\n");
  const std::string file = "--principals_file=" + principals;
  EXPECT_EQ(RunBinary({kServer, "--address=127.0.0.1:0", file, "--volume=a:1m", "--owner=a=carol"},
                      "", absl::Seconds(30)),
            2);
  EXPECT_EQ(RunBinary({kServer, "--address=127.0.0.1:0", file, "--volume=a:1m", "--owner=z=alice"},
                      "", absl::Seconds(30)),
            2);
}

TEST(BlockstoreRestartTest, FileVolumePersistsAcrossAGracefulRestart) {
  const std::string path = TempPath("persist.img");
  std::remove(path.c_str());
  const std::vector<std::string> args = {"--address=127.0.0.1:0", absl::StrCat("--token=", kToken),
                                         "--cores=-1", "--volume=p:4m:" + path};
  const std::string data = Bytes(1 << 20, 99);
  {
    auto server = testing::SpawnServer(kServer, args);
    ASSERT_TRUE(server.ok()) << server.status();
    auto client = BlockStoreClient::Connect(absl::StrCat("127.0.0.1:", server->second),
                                            Options(BulkMode::kServerExposes));
    ASSERT_TRUE(client.ok()) << client.status();
    auto buffer = (*client)->AllocateBuffer(1 << 20);
    ASSERT_TRUE(buffer.ok());
    std::memcpy(buffer->data(), data.data(), data.size());
    buffer->resize(data.size());
    ASSERT_TRUE((*client)->Write("p", 3 << 20, *buffer, nullptr, Bounded()).ok());
    client->reset();
    server->first.Signal(SIGINT);
    auto rc = server->first.Wait(absl::Seconds(15));
    ASSERT_TRUE(rc.ok()) << rc.status();
    EXPECT_EQ(*rc, 0);
  }
  auto server = testing::SpawnServer(kServer, args);
  ASSERT_TRUE(server.ok()) << server.status();
  auto client = BlockStoreClient::Connect(absl::StrCat("127.0.0.1:", server->second),
                                          Options(BulkMode::kMirror));
  ASSERT_TRUE(client.ok()) << client.status();
  auto buffer = (*client)->AllocateBuffer(1 << 20);
  ASSERT_TRUE(buffer.ok());
  ASSERT_TRUE((*client)->Read("p", 3 << 20, 1 << 20, &*buffer, nullptr, Bounded()).ok());
  EXPECT_TRUE(buffer->view() == data);
  client->reset();
  server->first.Signal(SIGTERM);
  auto rc = server->first.Wait(absl::Seconds(15));
  ASSERT_TRUE(rc.ok()) << rc.status();
  EXPECT_EQ(*rc, 0);
}

}  // namespace
}  // namespace swirl::blockstore
