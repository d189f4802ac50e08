// blockstore_load: a load generator for blockstore_server, in the manner of fio.
//
//   blockstore_load --server=host:7200 --token=t --volume=v --rw=randread --bs=64k --iodepth=16
//       --runtime=10
//   blockstore_load ... --rw=randrw --rwmixread=70 --bs=4k --iodepth=8 --number_ios=100000 --verify
//
// One connection (a caller-driven channel: the calling thread drives it with Channel::Poll and
// runs the completions, pinned with --core), --iodepth calls in flight at all times through the
// stub's allocation-free async form: each
// slot owns its ClientCall, its request and response messages and a registered BulkBuffer of
// --bs bytes that Read data lands in (CallOptions::response_bulk) and Write data leaves from
// (CallOptions::request_bulk). Offsets are uniformly random multiples of --bs inside the first
// --size bytes of the volume; no two calls in flight touch the same block.
//
// --verify: every write carries a pattern derived from (offset, generation) with a header and a
// CRC32C per 4 KiB sector (pattern.h), and its CRC32C, which the server checks; every read is
// checked against the CRC32C the server returns and against the data itself: each sector must
// be intact and in its place, and a block written during this run must hold exactly its last
// write. Reads of blocks not written in this run can only be checked for integrity (zeros and
// other writers' data are accepted), so use a --size small enough for the writes to cover it.
//
// Exit: 0 when every I/O succeeded and verified; 1 if any failed or any verification failed;
// 2 for bad flags; 3 if the connection or setup failed.

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "examples/blockstore/blockstore.pb.h"
#include "examples/blockstore/blockstore.swirl.h"
#include "examples/blockstore/checksum.h"
#include "examples/blockstore/client.h"
#include "examples/blockstore/histogram.h"
#include "examples/blockstore/pattern.h"
#include "examples/blockstore/volume.h"
#include "examples/common/tls_flags.h"
#include "swirl/channel.h"

ABSL_FLAG(std::string, server, "localhost:7200", "server control-plane address");
ABSL_FLAG(std::string, token, "", "authentication token");
ABSL_FLAG(std::string, device, "", "RDMA device (default: automatic)");
ABSL_FLAG(std::string, volume, "", "volume to load");
ABSL_FLAG(std::string, rw, "randread", "randread, randwrite or randrw");
ABSL_FLAG(int, rwmixread, 50, "randrw: percentage of reads");
ABSL_FLAG(std::string, bs, "4k", "block size: 4k..1m, a multiple of 4k (k/m suffixes)");
ABSL_FLAG(int, iodepth, 1, "calls in flight");
ABSL_FLAG(double, runtime, 0, "seconds to run (0: until --number_ios)");
ABSL_FLAG(int64_t, number_ios, 0, "I/Os to issue (0: until --runtime)");
ABSL_FLAG(std::string, size, "0", "use only the first SIZE bytes of the volume (0: all of it)");
ABSL_FLAG(bool, verify, false, "write a checkable pattern and verify every read (see above)");
ABSL_FLAG(std::string, bulk_mode, "server-exposes",
          "server-exposes (the data's holder exposes it) or mirror (the client exposes its "
          "buffers, NFS/RDMA style)");
ABSL_FLAG(bool, local_invalidation_only, false,
          "declare this side unable to do remote invalidation (measure the local fallback)");
ABSL_FLAG(int, core, -1, "pin the calling thread (which drives the connection) to this core");
ABSL_FLAG(bool, json, false, "print the results as one JSON object on stdout (text: stderr)");
ABSL_FLAG(int, timeout_ms, 10000, "per-I/O timeout");
ABSL_FLAG(uint64_t, seed, 0, "random seed (0: random)");

namespace {

namespace bs = swirl::blockstore;

constexpr uint64_t kUnknown = UINT64_MAX;  // expected generation of a block whose write failed

// Monotonic: a step of the system clock must not make a latency negative or move --runtime.
int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The human-readable report: stdout, or stderr when stdout carries --json.
FILE* g_text = stdout;

struct Slot {
  swirl::ClientCall call;
  bs::ReadRequest read_request;
  bs::ReadResponse read_response;
  bs::WriteRequest write_request;
  bs::WriteResponse write_response;
  swirl::BulkBuffer buffer;        // reads land here
  swirl::BulkBuffer write_buffer;  // writes leave from here (never a block just read)
  bool in_flight = false;
  bool is_read = false;
  uint64_t block = 0;
  uint64_t generation = 0;
  uint32_t crc = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  std::atomic<bool> done{false};
};

struct Totals {
  bs::LatencyHistogram latency;
  uint64_t ios = 0;
  uint64_t bytes = 0;
};

struct Config {
  std::string volume;
  std::string rw;
  int rwmixread = 50;
  uint32_t bs = 4096;
  int iodepth = 1;
  double runtime = 0;
  int64_t number_ios = 0;
  uint64_t size = 0;
  bool verify = false;
  std::string bulk_mode;
  bool local_invalidation_only = false;
  int core = -1;
  uint64_t seed = 0;
};

class Load {
 public:
  Load(const Config& config, bs::BlockStoreStub stub, bool blocking, uint64_t blocks)
      : config_(config),
        stub_(std::move(stub)),
        blocking_(blocking),
        blocks_(blocks),
        rng_(std::seed_seq{static_cast<uint32_t>(config.seed),
                           static_cast<uint32_t>(config.seed >> 32)}) {
    if (config_.verify) expected_.assign(blocks_, 0);
    // Not from the seeded generator: two runs with the same --seed would otherwise write the
    // same bytes, and a write of the second that the server dropped would read back as good.
    absl::BitGen fresh;
    run_id_ = absl::Uniform<uint64_t>(fresh) | 1;
  }

  absl::Status Setup(swirl::Channel& channel) {
    channel_ = &channel;
    for (int i = 0; i < config_.iodepth; ++i) {
      auto slot = std::make_unique<Slot>();
      auto buffer = channel.AllocateBulk(config_.bs);
      if (!buffer.ok()) return buffer.status();
      slot->buffer = std::move(*buffer);
      auto write_buffer = channel.AllocateBulk(config_.bs);
      if (!write_buffer.ok()) return write_buffer.status();
      slot->write_buffer = std::move(*write_buffer);
      slot->read_request.set_volume(config_.volume);
      slot->read_request.set_length(config_.bs);
      slot->write_request.set_volume(config_.volume);
      slot->write_request.set_length(config_.bs);
      // Without --verify writes send random bytes, deliberately not pattern sectors (a later
      // --verify run would take those for misplaced data). Reads land in the other buffer, so
      // a block just read (which may hold pattern sectors) is never written elsewhere.
      FillRandom(slot->write_buffer.data(), config_.bs);
      slot->write_buffer.resize(config_.bs);
      slot->buffer.resize(config_.bs);
      slots_.push_back(std::move(slot));
    }
    return absl::OkStatus();
  }

  void Run() {
    const int64_t timeout_ns = absl::GetFlag(FLAGS_timeout_ms) * int64_t{1000000};
    timeout_ = absl::Nanoseconds(timeout_ns);
    start_ns_ = NowNs();
    deadline_ns_ =
        config_.runtime > 0 ? start_ns_ + static_cast<int64_t>(config_.runtime * 1e9) : INT64_MAX;
    int in_flight = 0;
    for (auto& slot : slots_) {
      if (!MayIssue(NowNs())) break;
      Issue(*slot);
      ++in_flight;
    }
    while (in_flight > 0) {
      bool progressed = false;
      for (auto& slot : slots_) {
        Slot& s = *slot;
        if (!s.in_flight || !s.done.load(std::memory_order_acquire)) continue;
        progressed = true;
        Complete(s);
        --in_flight;
        if (MayIssue(s.end_ns)) {
          Issue(s);
          ++in_flight;
        }
      }
      // Drive the connection (completions run the slots' callbacks on this thread).
      if (!progressed && in_flight > 0) channel_->Poll();
    }
    end_ns_ = NowNs();
  }

  // --verify: reads back every block this run wrote, after it (as fio's verify does), so that
  // writes are checked against the volume even when the run itself read none of them back.
  // Not timed, not in the totals.
  void ReadBack() {
    if (!config_.verify || connection_lost_ || slots_.empty()) return;
    Slot& s = *slots_.front();
    for (uint64_t block = 0; block < blocks_ && !connection_lost_; ++block) {
      if (expected_[block] == 0 || expected_[block] == kUnknown) continue;
      s.is_read = true;
      s.block = block;
      s.read_request.set_offset(block * config_.bs);
      s.in_flight = true;
      Start(s);
      while (!s.done.load(std::memory_order_acquire)) channel_->Poll();
      s.in_flight = false;
      if (!s.call.status().ok()) {
        // An I/O error, not a verification failure: nothing was found wrong with the data (a
        // read-back cut short by a lost connection must not read as data that was not written).
        if (errors_++ < 5) {
          std::fprintf(stderr, "blockstore_load: read-back of offset %llu: %s\n",
                       static_cast<unsigned long long>(block * config_.bs),
                       s.call.status().ToString().c_str());
        }
        if (!channel_->connected()) connection_lost_ = true;
        continue;
      }
      const uint64_t failures = verify_failures_;
      VerifyRead(s);
      if (verify_failures_ == failures) ++read_back_;
    }
  }
  uint64_t read_back() const { return read_back_; }

  double elapsed_s() const { return static_cast<double>(end_ns_ - start_ns_) / 1e9; }
  const Totals& reads() const { return reads_; }
  const Totals& writes() const { return writes_; }
  uint64_t errors() const { return errors_; }
  uint64_t verify_failures() const { return verify_failures_; }
  uint64_t verified_reads() const { return verified_reads_; }
  uint64_t sectors_matched() const { return sectors_matched_; }
  uint64_t sectors_unverifiable() const { return sectors_unverifiable_; }
  uint64_t sectors_consistent() const { return sectors_consistent_; }
  uint64_t run_id() const { return run_id_; }

 private:
  void FillRandom(char* p, uint32_t n) {
    for (uint32_t i = 0; i + 8 <= n; i += 8) {
      uint64_t v = absl::Uniform<uint64_t>(rng_);
      if (i % bs::kSectorSize == 0 && v == bs::kPatternMagic) v = ~v;
      std::memcpy(p + i, &v, 8);
    }
  }

  bool MayIssue(int64_t now) const {
    if (connection_lost_) return false;
    if (config_.number_ios > 0 && issued_ >= config_.number_ios) return false;
    return now < deadline_ns_;
  }

  uint64_t PickBlock() {
    for (;;) {
      const uint64_t block = absl::Uniform<uint64_t>(rng_, 0, blocks_);
      bool busy = false;
      for (auto& slot : slots_) busy |= slot->in_flight && slot->block == block;
      if (!busy) return block;
    }
  }

  // A new I/O in slot `s`.
  void Issue(Slot& s) {
    ++issued_;
    s.is_read = config_.rw == "randread" ||
                (config_.rw == "randrw" && absl::Uniform<int>(rng_, 0, 100) < config_.rwmixread);
    s.block = PickBlock();
    const uint64_t offset = s.block * config_.bs;
    s.in_flight = true;
    if (s.is_read) {
      s.read_request.set_offset(offset);
    } else {
      s.write_request.set_offset(offset);
      if (config_.verify) {
        s.generation = ++generation_;
        bs::FillPattern(s.write_buffer.data(), offset, config_.bs, s.generation, run_id_);
        s.crc = bs::Crc32c(s.write_buffer.data(), config_.bs);
        s.write_request.set_has_crc32c(true);
        s.write_request.set_crc32c(s.crc);
      }
    }
    s.start_ns = NowNs();  // the I/O's latency, not the time to make its data
    Start(s);
  }

  // Starts the call of slot `s`.
  void Start(Slot& s) {
    s.done.store(false, std::memory_order_relaxed);
    Slot* self = &s;
    s.call.SetCallback([self](absl::Status) {
      self->end_ns = NowNs();
      self->done.store(true, std::memory_order_release);
    });
    swirl::CallOptions options;
    options.timeout = timeout_;
    if (s.is_read) {
      // Emptied first: a response that arrives without its data must not pass for one that
      // brought it (the size check in VerifyRead would see the last read's bytes).
      s.buffer.resize(0);
      options.response_bulk = &s.buffer;
      if (blocking_) {
        stub_.AsyncReadBlocking(&s.call, s.read_request, &s.read_response, options);
      } else {
        stub_.AsyncRead(&s.call, s.read_request, &s.read_response, options);
      }
      return;
    }
    options.request_bulk = &s.write_buffer;
    if (blocking_) {
      stub_.AsyncWriteBlocking(&s.call, s.write_request, &s.write_response, options);
    } else {
      stub_.AsyncWrite(&s.call, s.write_request, &s.write_response, options);
    }
  }

  void VerifyFailure(const std::string& what) {
    if (verify_failures_++ < 5) std::fprintf(stderr, "blockstore_load: VERIFY: %s\n", what.c_str());
  }

  void Complete(Slot& s) {
    s.in_flight = false;
    const uint64_t offset = s.block * config_.bs;
    const absl::Status& status = s.call.status();
    if (!status.ok()) {
      if (errors_++ < 5) {
        std::fprintf(stderr, "blockstore_load: %s at offset %llu: %s\n",
                     s.is_read ? "read" : "write", static_cast<unsigned long long>(offset),
                     status.ToString().c_str());
      }
      // A failed write may or may not have reached the volume.
      if (!s.is_read && config_.verify) expected_[s.block] = kUnknown;
      // Nothing more will get through a dead connection: finish with what is in flight.
      if (status.code() == absl::StatusCode::kUnavailable && !channel_->connected()) {
        connection_lost_ = true;
      }
      return;
    }
    Totals& t = s.is_read ? reads_ : writes_;
    t.latency.Add(static_cast<uint64_t>(s.end_ns - s.start_ns));
    ++t.ios;
    t.bytes += config_.bs;
    if (!config_.verify) return;
    if (!s.is_read) {
      if (s.write_response.crc32c() != s.crc || s.write_response.length() != config_.bs) {
        VerifyFailure(absl::StrFormat(
            "write at offset %u: the server stored %u bytes with "
            "CRC32C 0x%08x, sent %u with 0x%08x",
            offset, s.write_response.length(), s.write_response.crc32c(), config_.bs, s.crc));
        expected_[s.block] = kUnknown;
        return;
      }
      expected_[s.block] = s.generation;
      return;
    }
    VerifyRead(s);
  }

  // Checks the data a read of slot `s` brought against what this run wrote there.
  void VerifyRead(Slot& s) {
    const uint64_t offset = s.block * config_.bs;
    if (s.buffer.size() != config_.bs || s.read_response.length() != config_.bs) {
      VerifyFailure(absl::StrFormat("read at offset %u: received %u bytes (response says %u)",
                                    offset, s.buffer.size(), s.read_response.length()));
      return;
    }
    const uint32_t crc = bs::Crc32c(s.buffer.data(), config_.bs);
    if (crc != s.read_response.crc32c()) {
      VerifyFailure(
          absl::StrFormat("read at offset %u: data has CRC32C 0x%08x, the server "
                          "sent 0x%08x",
                          offset, crc, s.read_response.crc32c()));
      return;
    }
    const uint64_t expected = expected_[s.block];
    const bs::PatternCheck check = bs::CheckPattern(s.buffer.data(), offset, config_.bs, run_id_,
                                                    expected == kUnknown ? 0 : expected);
    if (!check.ok()) {
      VerifyFailure(absl::StrFormat("read at offset %u: %u of %u sectors wrong; %s", offset,
                                    check.bad, check.sectors, check.first_error));
      return;
    }
    if (expected != 0 && expected != kUnknown) ++verified_reads_;
    sectors_matched_ += check.matched;
    sectors_unverifiable_ += check.zero + check.foreign;
    sectors_consistent_ += check.consistent;
  }

  const Config config_;
  bs::BlockStoreStub stub_;
  const bool blocking_;
  const uint64_t blocks_;
  absl::BitGen rng_;
  uint64_t run_id_ = 0;
  absl::Duration timeout_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<uint64_t> expected_;  // per block: generation it must hold, 0: unknown
  uint64_t generation_ = 0;
  int64_t issued_ = 0;
  int64_t start_ns_ = 0;
  int64_t deadline_ns_ = 0;
  int64_t end_ns_ = 0;
  Totals reads_;
  Totals writes_;
  uint64_t errors_ = 0;
  uint64_t verify_failures_ = 0;
  uint64_t verified_reads_ = 0;
  uint64_t read_back_ = 0;
  uint64_t sectors_matched_ = 0;
  uint64_t sectors_unverifiable_ = 0;
  uint64_t sectors_consistent_ = 0;
  swirl::Channel* channel_ = nullptr;
  bool connection_lost_ = false;
};

int Usage(const std::string& why) {
  std::fprintf(stderr, "blockstore_load: %s\n", why.c_str());
  return 2;
}

struct Rates {
  double iops, mb_s, gb_s;
};

Rates RatesOf(const Totals& t, double seconds) {
  if (seconds <= 0) return {0, 0, 0};
  const double bytes = static_cast<double>(t.bytes);
  return {static_cast<double>(t.ios) / seconds, bytes / seconds / 1e6, bytes / seconds / 1e9};
}

std::string JsonTotals(const Totals& t, double seconds) {
  const Rates r = RatesOf(t, seconds);
  const auto& h = t.latency;
  auto us = [](uint64_t ns) { return static_cast<double>(ns) / 1e3; };
  return absl::StrFormat(
      "{\"ios\": %u, \"bytes\": %u, \"iops\": %.1f, \"mb_s\": %.2f, \"gb_s\": %.4f, "
      "\"lat_us\": {\"min\": %.2f, \"mean\": %.2f, \"p50\": %.2f, \"p90\": %.2f, \"p99\": %.2f, "
      "\"p99_9\": %.2f, \"max\": %.2f}}",
      t.ios, t.bytes, r.iops, r.mb_s, r.gb_s, us(h.min()), h.mean() / 1e3, us(h.Percentile(0.5)),
      us(h.Percentile(0.9)), us(h.Percentile(0.99)), us(h.Percentile(0.999)), us(h.max()));
}

void PrintTotals(const char* name, const Totals& t, double seconds) {
  if (t.ios == 0) return;
  const Rates r = RatesOf(t, seconds);
  const auto& h = t.latency;
  auto us = [](uint64_t ns) { return static_cast<double>(ns) / 1e3; };
  std::fprintf(g_text,
               "  %-5s: IOPS=%.0f, BW=%.1f MB/s (%.3f GB/s), %llu ios, %llu bytes\n"
               "         lat (us): min=%.2f mean=%.2f p50=%.2f p90=%.2f p99=%.2f p99.9=%.2f "
               "max=%.2f\n",
               name, r.iops, r.mb_s, r.gb_s, static_cast<unsigned long long>(t.ios),
               static_cast<unsigned long long>(t.bytes), us(h.min()), h.mean() / 1e3,
               us(h.Percentile(0.5)), us(h.Percentile(0.9)), us(h.Percentile(0.99)),
               us(h.Percentile(0.999)), us(h.max()));
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  Config config;
  config.volume = absl::GetFlag(FLAGS_volume);
  config.rw = absl::GetFlag(FLAGS_rw);
  config.rwmixread = absl::GetFlag(FLAGS_rwmixread);
  config.iodepth = absl::GetFlag(FLAGS_iodepth);
  config.runtime = absl::GetFlag(FLAGS_runtime);
  config.number_ios = absl::GetFlag(FLAGS_number_ios);
  config.verify = absl::GetFlag(FLAGS_verify);
  config.bulk_mode = absl::GetFlag(FLAGS_bulk_mode);
  config.local_invalidation_only = absl::GetFlag(FLAGS_local_invalidation_only);
  config.core = absl::GetFlag(FLAGS_core);
  config.seed = absl::GetFlag(FLAGS_seed);
  if (config.seed == 0) config.seed = absl::Uniform<uint64_t>(absl::BitGen());

  if (config.volume.empty()) return Usage("--volume is required");
  if (config.rw != "randread" && config.rw != "randwrite" && config.rw != "randrw") {
    return Usage("--rw is randread, randwrite or randrw");
  }
  if (config.rwmixread < 0 || config.rwmixread > 100) return Usage("--rwmixread is 0..100");
  auto block_size = bs::ParseSize(absl::GetFlag(FLAGS_bs));
  if (!block_size.ok()) return Usage(std::string(block_size.status().message()));
  if (*block_size < bs::kBlockSize || *block_size > bs::kMaxIoSize ||
      *block_size % bs::kBlockSize != 0) {
    return Usage("--bs must be a multiple of 4k between 4k and 1m");
  }
  config.bs = static_cast<uint32_t>(*block_size);
  if (config.iodepth < 1 || config.iodepth > 256) return Usage("--iodepth is 1..256");
  if (config.runtime < 0 || config.number_ios < 0) return Usage("negative --runtime/--number_ios");
  if (config.runtime > 366 * 86400.0) return Usage("--runtime above a year");
  if (config.runtime == 0 && config.number_ios == 0) {
    return Usage("give --runtime (seconds) or --number_ios (or both: whichever comes first)");
  }
  auto size = bs::ParseSize(absl::GetFlag(FLAGS_size));
  if (!size.ok()) return Usage(std::string(size.status().message()));
  config.size = *size;
  swirl::ChannelOptions options;
  if (config.bulk_mode == "mirror") {
    options.bulk_mode = swirl::BulkMode::kMirror;
  } else if (config.bulk_mode != "server-exposes") {
    return Usage("--bulk_mode is server-exposes or mirror");
  }

  if (config.core >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(config.core, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
      std::fprintf(stderr, "blockstore_load: cannot pin to core %d\n", config.core);
    }
  }
  options.auth_token = absl::GetFlag(FLAGS_token);
  options.client_name = "blockstore_load";
  swirl::examples::ApplyTlsFlags(options);
  options.transport.device = absl::GetFlag(FLAGS_device);
  options.driver = swirl::ChannelOptions::Driver::kCaller;
  if (config.local_invalidation_only) {
    options.transport.invalidation = swirl::InvalidationPolicy::kLocalOnly;
  }
  // Room for --iodepth responses (and a credit message) from the server at once.
  options.transport.credits = std::max<uint32_t>(32, static_cast<uint32_t>(config.iodepth) + 2);
  // One --bs buffer per slot, plus room for the library's own (mirror mode, large messages).
  size_t class_bytes = bs::kBlockSize;
  while (class_bytes < config.bs) class_bytes <<= 1;
  options.transport.bulk_pool_bytes =
      std::max<size_t>(64u << 20, class_bytes * static_cast<size_t>(config.iodepth) * 2);
  auto channel = swirl::Channel::Create(absl::GetFlag(FLAGS_server), options);
  if (!channel.ok()) {
    std::fprintf(stderr, "blockstore_load: cannot connect to %s: %s\n",
                 absl::GetFlag(FLAGS_server).c_str(), channel.status().ToString().c_str());
    return 3;
  }
  bs::BlockStoreClient client(*channel);
  auto info = client.Stat(config.volume, swirl::CallOptions{absl::Seconds(10)});
  if (!info.ok()) {
    std::fprintf(stderr, "blockstore_load: volume '%s': %s\n", config.volume.c_str(),
                 info.status().ToString().c_str());
    return 3;
  }
  if (config.size == 0 || config.size > info->size()) config.size = info->size();
  const uint64_t blocks = config.size / config.bs;
  if (blocks == 0) return Usage("--size/volume smaller than --bs");
  if (blocks < static_cast<uint64_t>(config.iodepth) * 2) {
    return Usage(
        absl::StrFormat("%u blocks of %u bytes is too few for --iodepth=%d (no two I/Os "
                        "in flight share a block): raise --size or lower --iodepth",
                        blocks, config.bs, config.iodepth));
  }

  if (absl::GetFlag(FLAGS_json)) g_text = stderr;
  const swirl::NegotiatedSettings& negotiated = (*channel)->negotiated();
  // A request keeps one credit back for returning credits: credits - 1 calls can be in flight.
  // Beyond that they would wait in the client's queue with their latency clocks running.
  if (static_cast<uint32_t>(config.iodepth) + 1 > negotiated.client_credits) {
    return Usage(absl::StrFormat(
        "--iodepth=%d needs %d credits; the server grants %u per connection (start "
        "blockstore_server with --credits=%d or more)",
        config.iodepth, config.iodepth + 1, negotiated.client_credits, config.iodepth + 1));
  }
  const std::string invalidation = swirl::ControlPlaneName(negotiated.invalidation);
  const std::string bulk_mode = swirl::ControlPlaneName(negotiated.bulk_mode);
  std::fprintf(g_text,
               "blockstore_load: %s%s bs=%s iodepth=%d volume=%s (%s, %s, %s) region=%s %s%s\n"
               "  channel: connection %llu, invalidation %s, bulk mode %s, %u credits, "
               "%u window credits, eager threshold %u\n",
               config.rw.c_str(),
               config.rw == "randrw" ? absl::StrCat(" rwmixread=", config.rwmixread).c_str() : "",
               bs::FormatSize(config.bs).c_str(), config.iodepth, config.volume.c_str(),
               bs::FormatSize(info->size()).c_str(),
               info->backing() == bs::BACKING_FILE ? "file" : "memory",
               info->blocking() ? "ReadBlocking/WriteBlocking" : "Read/Write on the worker",
               bs::FormatSize(config.size).c_str(),
               config.runtime > 0 ? absl::StrFormat("runtime=%gs", config.runtime).c_str() : "",
               config.number_ios > 0 ? absl::StrCat(" number_ios=", config.number_ios).c_str() : "",
               static_cast<unsigned long long>((*channel)->connection_id()), invalidation.c_str(),
               bulk_mode.c_str(), negotiated.client_credits, negotiated.window_credits,
               negotiated.eager_threshold);

  Load load(config, client.stub(), info->blocking(), blocks);
  if (absl::Status s = load.Setup(**channel); !s.ok()) {
    std::fprintf(stderr, "blockstore_load: %s\n", s.ToString().c_str());
    return 3;
  }
  load.Run();
  load.ReadBack();
  const swirl::ConnectionStats mine = (*channel)->LocalStats();
  // The server's view of this connection (its windows: downloads it exposed, grants it made).
  // Windows of the last I/Os may still be being revoked (the fallback's LOCAL_INV completes
  // after our call did): read until two readings agree, within a second.
  swirl::ConnectionStats theirs;
  bool have_theirs = false;
  const absl::Time settle_deadline = absl::Now() + absl::Seconds(1);
  for (swirl::ConnectionStats previous;;) {
    if (auto server_stats = (*channel)->ServerStats(); server_stats.ok()) {
      for (const auto& c : server_stats->connections) {
        if (c.connection_id == (*channel)->connection_id()) {
          theirs = c;
          have_theirs = true;
        }
      }
    }
    if (theirs == previous || absl::Now() > settle_deadline) break;
    previous = theirs;
    absl::SleepFor(absl::Milliseconds(20));
  }

  const double seconds = load.elapsed_s();
  Totals total;
  total.latency.Merge(load.reads().latency);
  total.latency.Merge(load.writes().latency);
  total.ios = load.reads().ios + load.writes().ios;
  total.bytes = load.reads().bytes + load.writes().bytes;
  std::fprintf(g_text, "  ran %.3f s\n", seconds);
  PrintTotals("read", load.reads(), seconds);
  PrintTotals("write", load.writes(), seconds);
  if (load.reads().ios > 0 && load.writes().ios > 0) PrintTotals("total", total, seconds);
  std::fprintf(g_text, "  errors=%llu verify_failures=%llu%s\n",
               static_cast<unsigned long long>(load.errors()),
               static_cast<unsigned long long>(load.verify_failures()),
               config.verify
                   ? absl::StrFormat(" (verified: %u reads of blocks written in this run, of "
                                     "which %u read back after it, %u "
                                     "sectors byte for byte; %u sectors of other runs intact; %u "
                                     "sectors unverifiable)",
                                     load.verified_reads(), load.read_back(),
                                     load.sectors_matched(),
                                     load.sectors_consistent(), load.sectors_unverifiable())
                         .c_str()
                   : " (not verifying)");
  auto windows = [](const swirl::ConnectionStats& s) {
    return absl::StrFormat(
        "granted=%u remote_invalidated=%u locally_invalidated=%u lease_expired=%u "
        "invalidation_violations=%u",
        s.windows_granted, s.windows_remote_invalidated, s.windows_locally_invalidated,
        s.windows_lease_expired, s.invalidation_violations);
  };
  std::fprintf(g_text, "  client windows: %s\n", windows(mine).c_str());
  if (have_theirs) std::fprintf(g_text, "  server windows: %s\n", windows(theirs).c_str());

  if (absl::GetFlag(FLAGS_json)) {
    auto json_windows = [](const swirl::ConnectionStats& s) {
      return absl::StrFormat(
          "{\"granted\": %u, \"remote_invalidated\": %u, \"locally_invalidated\": %u, "
          "\"lease_expired\": %u, \"invalidation_violations\": %u, \"requests_sent\": %u, "
          "\"responses_received\": %u, \"requests_received\": %u, \"responses_sent\": %u}",
          s.windows_granted, s.windows_remote_invalidated, s.windows_locally_invalidated,
          s.windows_lease_expired, s.invalidation_violations, s.requests_sent,
          s.responses_received, s.requests_received, s.responses_sent);
    };
    absl::PrintF(
        "{\"config\": {\"volume\": \"%s\", \"rw\": \"%s\", \"rwmixread\": %d, \"bs\": %u, "
        "\"iodepth\": %d, \"runtime_s\": %g, \"number_ios\": %d, \"size\": %u, "
        "\"verify\": %s, \"bulk_mode\": \"%s\", \"local_invalidation_only\": %s, \"core\": %d, "
        "\"seed\": %u, \"blocking\": %s},\n"
        " \"channel\": {\"connection_id\": %u, \"invalidation\": \"%s\", \"bulk_mode\": "
        "\"%s\", \"credits\": %u, \"window_credits\": %u, \"eager_threshold\": %u, "
        "\"max_bulk_size\": %u},\n"
        " \"elapsed_s\": %.6f,\n \"read\": %s,\n \"write\": %s,\n \"total\": %s,\n"
        " \"errors\": %u, \"verify_failures\": %u, \"verified_reads\": %u, \"read_back\": %u, "
        "\"sectors_matched\": %u, \"sectors_consistent\": %u, \"sectors_unverifiable\": %u,\n"
        " \"client_windows\": %s,\n \"server_windows\": %s}\n",
        config.volume, config.rw, config.rwmixread, config.bs, config.iodepth, config.runtime,
        config.number_ios, config.size, config.verify ? "true" : "false", config.bulk_mode,
        config.local_invalidation_only ? "true" : "false", config.core, config.seed,
        info->blocking() ? "true" : "false", (*channel)->connection_id(), invalidation, bulk_mode,
        negotiated.client_credits, negotiated.window_credits, negotiated.eager_threshold,
        negotiated.max_bulk_size, seconds, JsonTotals(load.reads(), seconds),
        JsonTotals(load.writes(), seconds), JsonTotals(total, seconds), load.errors(),
        load.verify_failures(), load.verified_reads(), load.read_back(), load.sectors_matched(),
        load.sectors_consistent(), load.sectors_unverifiable(), json_windows(mine),
        have_theirs ? json_windows(theirs) : std::string("null"));
    std::fflush(stdout);
  }
  return load.errors() == 0 && load.verify_failures() == 0 ? 0 : 1;
}
