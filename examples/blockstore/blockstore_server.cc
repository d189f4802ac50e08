// blockstore_server: serves swirl.blockstore.BlockStore over volumes in memory or in files until
// SIGINT or SIGTERM, then shuts down gracefully and prints what it served.
//
//   blockstore_server --address=0.0.0.0:7200 --token=secret --cores=1
//       --volume=fast:1g --volume=disk:4g:/var/tmp/disk.img
//
// Volumes: --volume=name:size[:path], repeatable and/or comma separated. Without a path the
// volume lives in memory (zero-filled; gone at exit) and Read/Write are served on the polling
// worker. With a path it is a file (created if missing, grown to `size` if shorter), read and
// written with pread/pwrite on the handler thread pool (ReadBlocking/WriteBlocking), since file
// I/O may block; it is fdatasync'ed at shutdown.
//
// Tenants: --principals_file names them, a line each (# starts a comment):
//   alice token=alice-secret
//   bob   identity=bob.clients.example        (a client certificate's SAN or CN; --tls_client_ca)
//   ops   token=ops-secret admin              (Stats shows an admin every connection)
// and --owner=volume=principal (repeatable, or comma separated) gives a volume to one of them:
// anyone else is refused it (PERMISSION_DENIED) and does not see it listed. --token is the
// principal "default".
//
// TLS: --tls_cert and --tls_key (PEM) for the control plane; with --tls_client_ca clients must
// present a certificate that CA signed (examples/common/tls_flags.h).
//
// Exit: 0 after a graceful shutdown, 1 if the server cannot start, 2 for bad flags.

#include <arpa/inet.h>
#include <pthread.h>
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "examples/blockstore/checksum.h"
#include "examples/common/tls_flags.h"
#include "examples/blockstore/service.h"
#include "examples/blockstore/volume.h"
#include "swirl/server.h"

ABSL_FLAG(std::string, address, "127.0.0.1:7200",
          "control-plane listen address (port 0: pick); beyond loopback it needs --token (or "
          "--insecure)");
ABSL_FLAG(std::string, token, "", "clients must present this token (empty: no auth)");
ABSL_FLAG(std::string, principals_file, "",
          "tenants, a line each: name [token=T] [identity=I] [admin] (see above)");
ABSL_FLAG(std::vector<std::string>, owner, {},
          "volume=principal: only that principal may use the volume (repeatable, or comma "
          "separated)");
ABSL_FLAG(bool, insecure, false,
          "listen beyond loopback without a token: anyone who can reach the address may read and "
          "write every volume");
ABSL_FLAG(std::string, cores, "1", "comma-separated cores, one pinned worker each (-1: unpinned)");
ABSL_FLAG(std::string, device, "", "RDMA device (default: automatic, soft0 without hardware)");
ABSL_FLAG(std::string, port_file, "", "write the chosen port here once listening");
ABSL_FLAG(std::vector<std::string>, volume, {},
          "name:size[:path]; repeatable, or comma separated (no path: in memory)");
ABSL_FLAG(int, handler_threads, 4, "threads for ReadBlocking/WriteBlocking (file-backed volumes)");
ABSL_FLAG(int, credits, 64,
          "receive buffers per connection: a client may have credits - 1 calls in flight");
ABSL_FLAG(int, bulk_pool_mb, 128, "registered memory for bulk data, per worker (MiB)");
ABSL_FLAG(int, window_credits, 8,
          "upload windows granted ahead of need per connection and size class (the negotiated "
          "value is the smaller of this and the client's, which swirl fixes at 8)");
ABSL_FLAG(bool, busy_poll, false, "never sleep on the completion channel when idle");
ABSL_FLAG(int, shutdown_ms, 5000, "graceful shutdown deadline");

namespace {

using swirl::blockstore::FormatSize;

// Whether `address` (host:port, or a gRPC unix: address) only listens on this host: a Unix
// socket, "localhost", or a literal loopback address (not a name that merely starts with 127.).
bool LoopbackOnly(const std::string& address) {
  if (absl::StartsWith(address, "unix:")) return true;
  const size_t colon = address.rfind(':');
  std::string host = address.substr(0, colon == std::string::npos ? address.size() : colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "localhost") return true;
  in_addr v4;
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  return inet_pton(AF_INET6, host.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

// absl keeps only the last occurrence of a flag; --volume and --owner are repeatable, so collect
// them all.
std::vector<std::string> RepeatedFlagValues(int argc, char** argv, const std::string& name) {
  std::vector<std::string> values;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") break;
    for (const std::string& prefix : {"--" + name + "=", "-" + name + "="}) {
      if (absl::StartsWith(arg, prefix)) values.push_back(arg.substr(prefix.size()));
    }
    if ((arg == "--" + name || arg == "-" + name) && i + 1 < argc) values.push_back(argv[++i]);
  }
  return values;
}

// --principals_file's tenants. Errors name the line, never a token.
absl::StatusOr<std::vector<swirl::Principal>> ReadPrincipals(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::vector<swirl::Principal> out;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    line = line.substr(0, line.find('#'));
    std::vector<std::string> words =
        absl::StrSplit(line, absl::ByAnyChar(" \t"), absl::SkipEmpty());
    if (words.empty()) continue;
    swirl::Principal p{.name = words[0]};
    for (size_t i = 1; i < words.size(); ++i) {
      if (absl::StartsWith(words[i], "token=")) {
        p.token = words[i].substr(6);
      } else if (absl::StartsWith(words[i], "identity=")) {
        p.tls_identity = words[i].substr(9);
      } else if (words[i] == "admin") {
        p.admin = true;
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ":", number, ": expected token=, identity= or admin after the name"));
      }
    }
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  // SIGINT/SIGTERM are blocked in every thread (the server's threads inherit the mask) and
  // taken synchronously by sigwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  const std::vector<std::string> volume_values = RepeatedFlagValues(argc, argv, "volume");
  const std::vector<std::string> owner_values = RepeatedFlagValues(argc, argv, "owner");
  absl::ParseCommandLine(argc, argv);
  auto specs = swirl::blockstore::ParseVolumeSpecs(volume_values);
  if (!specs.ok()) {
    std::fprintf(stderr, "blockstore_server: %s\n", specs.status().ToString().c_str());
    return 2;
  }
  if (specs->empty()) {
    std::fprintf(stderr, "blockstore_server: no volumes: give --volume=name:size[:path]\n");
    return 2;
  }
  std::vector<swirl::Principal> principals;
  if (!absl::GetFlag(FLAGS_principals_file).empty()) {
    auto read = ReadPrincipals(absl::GetFlag(FLAGS_principals_file));
    if (!read.ok()) {
      std::fprintf(stderr, "blockstore_server: %s\n", read.status().ToString().c_str());
      return 2;
    }
    principals = *std::move(read);
  }
  swirl::blockstore::BlockStoreServer::Owners owners;
  for (const std::string& value : owner_values) {
    for (absl::string_view entry : absl::StrSplit(value, ',', absl::SkipEmpty())) {
      std::pair<std::string, std::string> pair = absl::StrSplit(entry, absl::MaxSplits('=', 1));
      if (pair.first.empty() || pair.second.empty()) {
        std::fprintf(stderr, "blockstore_server: --owner wants volume=principal, not '%s'\n",
                     std::string(entry).c_str());
        return 2;
      }
      owners[pair.first] = pair.second;
    }
  }
  for (const auto& [volume, principal] : owners) {
    const bool known =
        principal == "default" ? !absl::GetFlag(FLAGS_token).empty()
                               : std::any_of(principals.begin(), principals.end(),
                                             [&](const swirl::Principal& p) {
                                               return p.name == principal;
                                             });
    const bool exists = std::any_of(specs->begin(), specs->end(),
                                    [&](const auto& spec) { return spec.name == volume; });
    if (!known || !exists) {
      std::fprintf(stderr, "blockstore_server: --owner=%s=%s: no such %s\n", volume.c_str(),
                   principal.c_str(), exists ? "principal" : "volume");
      return 2;
    }
  }
  swirl::ServerOptions options;
  options.address = absl::GetFlag(FLAGS_address);
  options.auth_token = absl::GetFlag(FLAGS_token);
  options.principals = std::move(principals);
  swirl::examples::ApplyTlsFlags(options);
  options.allow_insecure_non_loopback = absl::GetFlag(FLAGS_insecure);
  options.transport.device = absl::GetFlag(FLAGS_device);
  if (options.auth_token.empty() && options.principals.empty() &&
      options.tls_cert_file.empty() && !absl::GetFlag(FLAGS_insecure) &&
      !LoopbackOnly(absl::GetFlag(FLAGS_address))) {
    std::fprintf(stderr,
                 "blockstore_server: %s is reachable beyond this host and there is no --token, "
                 "--principals_file or TLS: anyone could read and write every volume. Give "
                 "--token, or --insecure to accept that\n",
                 absl::GetFlag(FLAGS_address).c_str());
    return 2;
  }
  options.handler_threads = absl::GetFlag(FLAGS_handler_threads);
  options.transport.credits = static_cast<uint32_t>(absl::GetFlag(FLAGS_credits));
  options.transport.bulk_pool_bytes = static_cast<size_t>(absl::GetFlag(FLAGS_bulk_pool_mb)) << 20;
  if (absl::GetFlag(FLAGS_window_credits) < 1) {
    std::fprintf(stderr, "blockstore_server: --window_credits >= 1\n");
    return 2;
  }
  options.window_credits = static_cast<uint32_t>(absl::GetFlag(FLAGS_window_credits));
  options.worker_cores.clear();
  for (absl::string_view core : absl::StrSplit(absl::GetFlag(FLAGS_cores), ',')) {
    int c;
    if (!absl::SimpleAtoi(core, &c)) {
      std::fprintf(stderr, "blockstore_server: bad --cores entry '%s'\n",
                   std::string(core).c_str());
      return 2;
    }
    options.worker_cores.push_back(c);
  }
  if (absl::GetFlag(FLAGS_busy_poll)) options.idle_spin = absl::ZeroDuration();
  if (options.handler_threads < 1 || absl::GetFlag(FLAGS_bulk_pool_mb) < 4) {
    std::fprintf(stderr, "blockstore_server: --handler_threads >= 1, --bulk_pool_mb >= 4\n");
    return 2;
  }

  swirl::blockstore::VolumeSet volumes;
  for (const auto& spec : *specs) {
    if (absl::Status s = volumes.Add(spec); !s.ok()) {
      std::fprintf(stderr, "blockstore_server: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  swirl::blockstore::BlockStoreServer service(&volumes, std::move(owners));
  swirl::Server server(options);
  if (absl::Status s = server.RegisterService(&service); !s.ok()) {
    std::fprintf(stderr, "blockstore_server: %s\n", s.ToString().c_str());
    return 1;
  }
  if (absl::Status s = server.Start(); !s.ok()) {
    std::fprintf(stderr, "blockstore_server: %s\n", s.ToString().c_str());
    return 1;
  }
  const auto& caps = server.capabilities();
  std::printf(
      "blockstore_server: listening on port %d, device %s (%s), remote invalidation %s, "
      "%zu worker(s), CRC32C %s\n",
      server.port(), caps.device.c_str(), caps.kind.c_str(),
      caps.remote_invalidation ? "yes" : "no", options.worker_cores.size(),
      swirl::blockstore::Crc32cIsHardware() ? "sse4.2" : "portable");
  for (swirl::blockstore::Volume* v : volumes.volumes()) {
    std::printf("  volume %-12s %8s  %s\n", v->name().c_str(), FormatSize(v->size()).c_str(),
                v->file_backed()
                    ? ("file " + v->path() + " (pread/pwrite on the handler pool)").c_str()
                    : "memory (served on the worker)");
  }
  std::fflush(stdout);
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    const std::string path = absl::GetFlag(FLAGS_port_file);
    const std::string tmp = path + ".tmp";
    { std::ofstream(tmp) << server.port() << "\n"; }
    std::rename(tmp.c_str(), path.c_str());  // readers never see a partial file
  }

  int signal = 0;
  sigwait(&stop_signals, &signal);
  std::printf("blockstore_server: %s, shutting down\n", signal == SIGINT ? "SIGINT" : "SIGTERM");
  std::fflush(stdout);

  // The engine's totals go with its workers at shutdown, so they are read first; the volumes'
  // counters below are read after the drain and include the calls it let finish.
  swirl::StatsReport stats = server.Stats();
  server.Shutdown(absl::Milliseconds(absl::GetFlag(FLAGS_shutdown_ms)));
  int rc = 0;
  uint64_t reads = 0, writes = 0, bytes_read = 0, bytes_written = 0, errors = 0;
  for (swirl::blockstore::Volume* v : volumes.volumes()) {
    auto& c = v->counters();
    reads += c.reads.load();
    writes += c.writes.load();
    bytes_read += c.bytes_read.load();
    bytes_written += c.bytes_written.load();
    errors += c.errors.load();
    std::printf("  volume %-12s reads %llu (%llu bytes), writes %llu (%llu bytes), errors %llu\n",
                v->name().c_str(), static_cast<unsigned long long>(c.reads.load()),
                static_cast<unsigned long long>(c.bytes_read.load()),
                static_cast<unsigned long long>(c.writes.load()),
                static_cast<unsigned long long>(c.bytes_written.load()),
                static_cast<unsigned long long>(c.errors.load()));
    if (absl::Status s = v->Sync(); !s.ok()) {
      std::fprintf(stderr, "blockstore_server: %s\n", s.ToString().c_str());
      rc = 1;
    }
  }
  const auto& s = stats.server;
  uint64_t granted = 0;
  for (const auto& c : stats.connections) granted += c.windows_granted;
  std::printf(
      "blockstore_server: served %llu requests (before the drain) on %llu connections (%llu "
      "refused): "
      "%llu reads (%llu bytes), %llu writes (%llu bytes), %llu errors, %llu protocol "
      "errors\n",
      static_cast<unsigned long long>(s.requests),
      static_cast<unsigned long long>(s.connections_accepted),
      static_cast<unsigned long long>(s.connections_refused),
      static_cast<unsigned long long>(reads), static_cast<unsigned long long>(bytes_read),
      static_cast<unsigned long long>(writes), static_cast<unsigned long long>(bytes_written),
      static_cast<unsigned long long>(errors),
      static_cast<unsigned long long>(s.protocol_errors));
  std::printf(
      "blockstore_server: windows: %llu remotely invalidated, %llu locally invalidated, "
      "%llu lease expired, %llu invalidation violations, %llu outstanding, %llu upload "
      "windows granted to connections still open, %llu bulk bytes in use\n",
      static_cast<unsigned long long>(s.windows_remote_invalidated),
      static_cast<unsigned long long>(s.windows_locally_invalidated),
      static_cast<unsigned long long>(s.windows_lease_expired),
      static_cast<unsigned long long>(s.invalidation_violations),
      static_cast<unsigned long long>(s.windows_outstanding),
      static_cast<unsigned long long>(granted),
      static_cast<unsigned long long>(s.bulk_bytes_in_use));
  return rc;
}
