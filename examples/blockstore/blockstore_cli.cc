// blockstore_cli: one-shot reads, writes and stats against a blockstore_server.
//
//   blockstore_cli --server=host:7200 --token=t stat [--volume=v]
//   blockstore_cli --server=host:7200 --token=t read  --volume=v --offset=0 --length=64k > out
//   blockstore_cli --server=host:7200 --token=t write --volume=v --offset=0 < in
//   blockstore_cli --server=host:7200 --token=t write --volume=v --offset=1m --input=file --pad
//   blockstore_cli --server=host:7200 --token=t --tls_ca=ca.pem stat  (examples/common/tls_flags.h)
//
// Data goes through registered memory both ways (zero-copy bulk attachments). Ranges larger than
// 1 MiB are split into 1 MiB requests. Offsets and lengths take k/m/g suffixes and must be
// multiples of 4 KiB; `write` takes its length from the input (a multiple of 4 KiB, or --pad it
// with zeros). Every read is checked against the server's CRC32C; every write sends its CRC32C,
// which the server checks before writing.
//
// Exit codes:
//   0  success
//   1  any other failure (the RPC failed: UNAVAILABLE, INTERNAL, ...)
//   2  usage error (bad flags or subcommand, unreadable input, unaligned input without --pad)
//   3  cannot connect (control plane unreachable, authentication refused)
//   4  no such volume (NOT_FOUND)
//   5  request refused by the server: INVALID_ARGUMENT, OUT_OF_RANGE, FAILED_PRECONDITION
//   6  data corrupted: a CRC32C mismatch (DATA_LOSS)
//   7  the volume belongs to another principal (PERMISSION_DENIED)

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "examples/blockstore/client.h"
#include "examples/blockstore/volume.h"
#include "examples/common/tls_flags.h"

ABSL_FLAG(std::string, server, "localhost:7200", "server control-plane address");
ABSL_FLAG(std::string, token, "", "authentication token");
ABSL_FLAG(std::string, device, "", "RDMA device (default: automatic)");
ABSL_FLAG(std::string, volume, "", "volume name (stat: empty lists every volume)");
ABSL_FLAG(std::string, offset, "0", "byte offset (k/m/g suffixes; a multiple of 4k)");
ABSL_FLAG(std::string, length, "4k", "read: bytes to read (k/m/g suffixes; a multiple of 4k)");
ABSL_FLAG(std::string, input, "-", "write: file to write ('-': stdin)");
ABSL_FLAG(std::string, output, "-", "read: file to write the data to ('-': stdout)");
ABSL_FLAG(bool, pad, false, "write: pad the input with zeros to a multiple of 4k");
ABSL_FLAG(std::string, bulk_mode, "server-exposes", "server-exposes or mirror");
ABSL_FLAG(int, timeout_ms, 10000, "per-request timeout");

namespace {

namespace bs = swirl::blockstore;

enum Exit {
  kOk = 0,
  kFailed = 1,
  kUsage = 2,
  kConnect = 3,
  kNotFound = 4,
  kRefused = 5,
  kCorrupt = 6,
  kDenied = 7,
};

int ExitFor(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kOk:
      return kOk;
    case absl::StatusCode::kNotFound:
      return kNotFound;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition:
      return kRefused;
    case absl::StatusCode::kDataLoss:
      return kCorrupt;
    case absl::StatusCode::kPermissionDenied:
      return kDenied;
    default:
      return kFailed;
  }
}

int Fail(const char* what, const absl::Status& s) {
  std::fprintf(stderr, "blockstore_cli: %s: %s\n", what, s.ToString().c_str());
  return ExitFor(s);
}

int Usage(const std::string& why) {
  std::fprintf(stderr,
               "blockstore_cli: %s\nusage: blockstore_cli [--server=..] [--token=..] "
               "stat|read|write [--volume=..] [--offset=..] [--length=..] [--input=..] "
               "[--output=..]\n",
               why.c_str());
  return kUsage;
}

void PrintVolume(const bs::VolumeInfo& v) {
  std::printf(
      "%-12s %10s  %-6s %-8s reads %llu (%llu bytes)  writes %llu (%llu bytes)  "
      "errors %llu%s%s\n",
      v.name().c_str(), bs::FormatSize(v.size()).c_str(),
      v.backing() == bs::BACKING_FILE ? "file" : "memory", v.blocking() ? "blocking" : "worker",
      static_cast<unsigned long long>(v.reads()), static_cast<unsigned long long>(v.bytes_read()),
      static_cast<unsigned long long>(v.writes()),
      static_cast<unsigned long long>(v.bytes_written()),
      static_cast<unsigned long long>(v.errors()), v.path().empty() ? "" : "  ", v.path().c_str());
}

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("blockstore_cli [flags] stat|read|write");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) return Usage("give exactly one subcommand: stat, read or write");
  const std::string command = args[1];
  if (command != "stat" && command != "read" && command != "write") {
    return Usage("unknown subcommand '" + command + "'");
  }
  const std::string volume = absl::GetFlag(FLAGS_volume);
  if (command != "stat" && volume.empty()) return Usage("--volume is required");
  auto offset = bs::ParseSize(absl::GetFlag(FLAGS_offset));
  if (!offset.ok()) return Usage(std::string(offset.status().message()));

  swirl::ChannelOptions options;
  options.auth_token = absl::GetFlag(FLAGS_token);
  options.client_name = "blockstore_cli";
  swirl::examples::ApplyTlsFlags(options);
  options.transport.device = absl::GetFlag(FLAGS_device);
  options.driver = swirl::ChannelOptions::Driver::kCaller;
  const std::string mode = absl::GetFlag(FLAGS_bulk_mode);
  if (mode == "mirror") {
    options.bulk_mode = swirl::BulkMode::kMirror;
  } else if (mode != "server-exposes") {
    return Usage("--bulk_mode is server-exposes or mirror");
  }
  swirl::CallOptions call_options;
  call_options.timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms));

  // Input first: a usage error should not cost a connection.
  std::string input;
  if (command == "write") {
    const std::string path = absl::GetFlag(FLAGS_input);
    // read(2) to the end: a read error must not pass for the end of the input (a truncated
    // prefix would be written and reported as success), as it does through stream iterators.
    const int fd = path == "-" ? 0 : open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Usage(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
    char chunk[65536];
    for (;;) {
      const ssize_t n = read(fd, chunk, sizeof(chunk));
      if (n > 0) {
        input.append(chunk, static_cast<size_t>(n));
      } else if (n == 0) {
        break;
      } else if (errno != EINTR) {
        const int err = errno;
        if (fd != 0) close(fd);
        return Usage(absl::StrCat("error reading ", path == "-" ? "standard input" : path, ": ",
                                  std::strerror(err)));
      }
    }
    if (fd != 0) close(fd);
    if (input.size() % bs::kBlockSize != 0) {
      if (!absl::GetFlag(FLAGS_pad)) {
        return Usage(absl::StrFormat("the input has %u bytes, not a multiple of %u (use --pad)",
                                     input.size(), bs::kBlockSize));
      }
      input.resize((input.size() + bs::kBlockSize - 1) / bs::kBlockSize * bs::kBlockSize, '\0');
    }
    if (input.empty()) return Usage("nothing to write");
  }
  uint64_t length = 0;
  if (command == "read") {
    auto parsed = bs::ParseSize(absl::GetFlag(FLAGS_length));
    if (!parsed.ok()) return Usage(std::string(parsed.status().message()));
    length = *parsed;
    if (length == 0 || length % bs::kBlockSize != 0) {
      return Usage(absl::StrFormat("--length must be a positive multiple of %u", bs::kBlockSize));
    }
  }

  auto client = bs::BlockStoreClient::Connect(absl::GetFlag(FLAGS_server), options);
  if (!client.ok()) {
    std::fprintf(stderr, "blockstore_cli: cannot connect to %s: %s\n",
                 absl::GetFlag(FLAGS_server).c_str(), client.status().ToString().c_str());
    return kConnect;
  }

  if (command == "stat") {
    if (volume.empty()) {
      auto all = (*client)->ListVolumes(call_options);
      if (!all.ok()) return Fail("ListVolumes", all.status());
      for (const auto& v : *all) PrintVolume(v);
    } else {
      auto one = (*client)->Stat(volume, call_options);
      if (!one.ok()) return Fail("Stat", one.status());
      PrintVolume(*one);
    }
    return kOk;
  }

  auto buffer = (*client)->AllocateBuffer(bs::kMaxIoSize);
  if (!buffer.ok()) return Fail("AllocateBuffer", buffer.status());
  if (command == "read") {
    const std::string path = absl::GetFlag(FLAGS_output);
    FILE* out = path == "-" ? stdout : std::fopen(path.c_str(), "wb");
    if (out == nullptr) return Usage("cannot write " + path);
    const int fd = fileno(out);
    for (uint64_t done = 0; done < length;) {
      const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(length - done, bs::kMaxIoSize));
      bs::ReadResponse response;
      absl::Status s =
          (*client)->Read(volume, *offset + done, n, &*buffer, &response, call_options);
      if (!s.ok()) return Fail("Read", s);
      if (!WriteAll(fd, buffer->data(), n)) {
        std::fprintf(stderr, "blockstore_cli: writing %s failed\n", path.c_str());
        return kFailed;
      }
      std::fprintf(stderr, "read %u bytes at offset %llu of %s, CRC32C 0x%08x\n", n,
                   static_cast<unsigned long long>(*offset + done), volume.c_str(),
                   response.crc32c());
      done += n;
    }
    if (out != stdout && std::fclose(out) != 0) return kFailed;
    return kOk;
  }

  for (size_t done = 0; done < input.size();) {
    const uint32_t n = static_cast<uint32_t>(std::min<size_t>(input.size() - done, bs::kMaxIoSize));
    std::memcpy(buffer->data(), input.data() + done, n);
    buffer->resize(n);
    bs::WriteResponse response;
    absl::Status s = (*client)->Write(volume, *offset + done, *buffer, &response, call_options);
    if (!s.ok()) return Fail("Write", s);
    std::fprintf(stderr, "wrote %u bytes at offset %llu of %s, CRC32C 0x%08x\n", n,
                 static_cast<unsigned long long>(*offset + done), volume.c_str(),
                 response.crc32c());
    done += n;
  }
  return kOk;
}
