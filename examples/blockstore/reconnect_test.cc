// A verified blockstore load through a server killed with SIGKILL and started again on the
// same address (issue 21, docs/RELIABILITY.md): the client's channel reconnects by itself,
// every write acknowledged before the kill reads back, and no write that failed is reported as
// done. The volume is file-backed, so what the server wrote survives its death (the page cache
// keeps it; a machine crash is another matter).

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/mutex.h"
#include "examples/blockstore/client.h"
#include "gtest/gtest.h"
#include "swirl/channel.h"
#include "rpc/testing/process.h"

namespace swirl::blockstore {
namespace {

constexpr char kServer[] = "examples/blockstore/blockstore_server";
constexpr char kToken[] = "blockstore-reconnect";
constexpr uint32_t kBlock = 4096;
constexpr int kBlocks = 256;  // a 1 MiB volume

std::string TempPath(const std::string& name) {
  const char* dir = std::getenv("TEST_TMPDIR");
  return absl::StrCat(dir != nullptr ? dir : "/tmp", "/", name);
}

// Generation `gen`'s contents for a block: every generation differs in every 8-byte word.
void Fill(char* out, uint64_t gen, int block) {
  for (uint32_t i = 0; i < kBlock; i += 8) {
    const uint64_t word = (gen << 32) ^ (uint64_t(block) << 16) ^ i ^ 0x9e3779b97f4a7c15ull;
    std::memcpy(out + i, &word, 8);
  }
}

std::pair<testing::ChildProcess, int> StartServer(const std::string& path, int port) {
  auto server = testing::SpawnServer(
      kServer, {absl::StrCat("--address=127.0.0.1:", port), absl::StrCat("--token=", kToken),
                "--cores=-1", absl::StrCat("--volume=v:1m:", path)});
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) std::abort();
  return std::move(*server);
}

// What the client knows of each block: the generation last acknowledged (0: never written,
// zeros), and the generations written since whose outcome is unknown (the call failed: the
// server may or may not have written them before it died).
struct Ledger {
  swirl::Mutex mu;
  std::vector<uint64_t> acked = std::vector<uint64_t>(kBlocks, 0);
  std::vector<std::set<uint64_t>> unknown = std::vector<std::set<uint64_t>>(kBlocks);
  int acks = 0;
  int failures = 0;
  std::string unexpected;  // a failure that a lost connection does not explain
};

TEST(BlockstoreReconnect, AVerifiedLoadSurvivesTheServerKilledAndRestarted) {
  const std::string path = TempPath("reconnect.img");
  std::remove(path.c_str());
  auto [server, port] = StartServer(path, 0);
  const std::string address = absl::StrCat("127.0.0.1:", port);

  ChannelOptions options;
  options.auth_token = kToken;
  options.client_name = "blockstore_reconnect_test";
  options.reconnect.initial_backoff = absl::Milliseconds(200);
  options.reconnect.max_backoff = absl::Seconds(1);
  options.transport.keepalive = absl::Milliseconds(200);
  auto client = BlockStoreClient::Connect(address, options);
  ASSERT_TRUE(client.ok()) << client.status();
  BlockStoreClient& c = **client;
  auto buffer = c.AllocateBuffer(kBlock);
  ASSERT_TRUE(buffer.ok()) << buffer.status();

  Ledger ledger;
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    absl::BitGen random;
    for (uint64_t gen = 1; !stop.load(); ++gen) {
      const int block = absl::Uniform(random, 0, kBlocks);
      Fill(buffer->data(), gen, block);
      buffer->resize(kBlock);
      CallOptions call;
      call.timeout = absl::Seconds(5);
      const absl::Status s = c.Write("v", uint64_t(block) * kBlock, *buffer, nullptr, call);
      swirl::MutexLock lock(&ledger.mu);
      if (s.ok()) {
        ledger.acked[block] = gen;
        ledger.unknown[block].clear();
        ++ledger.acks;
        continue;
      }
      ledger.unknown[block].insert(gen);
      ++ledger.failures;
      if (s.code() != absl::StatusCode::kUnavailable &&
          s.code() != absl::StatusCode::kDeadlineExceeded && ledger.unexpected.empty()) {
        ledger.unexpected = s.ToString();
      }
      ledger.mu.Unlock();
      // Down: wait (bounded) for the reconnect instead of spinning on failing calls.
      c.channel().WaitForReady(absl::Now() + absl::Milliseconds(100));
      ledger.mu.Lock();
    }
  });
  auto wait_for = [&](auto done, absl::Duration limit) {
    swirl::MutexLock lock(&ledger.mu);
    return ledger.mu.AwaitWithTimeout(absl::Condition(&done), limit);
  };

  ASSERT_TRUE(wait_for([&] { return ledger.acks >= 200; }, absl::Seconds(60)));
  server.Kill();
  EXPECT_TRUE(wait_for([&] { return ledger.failures >= 1; }, absl::Seconds(30)))
      << "the writer never noticed the server's death";
  int acks_at_restart = 0;
  {
    swirl::MutexLock lock(&ledger.mu);
    acks_at_restart = ledger.acks;
  }
  auto restarted = StartServer(path, port);
  ASSERT_TRUE(c.channel().WaitForReady(absl::Now() + absl::Seconds(30)))
      << "the channel did not reconnect: " << c.channel().last_error();
  EXPECT_GE(c.channel().reconnects(), 1u);
  EXPECT_TRUE(wait_for([&] { return ledger.acks >= acks_at_restart + 200; }, absl::Seconds(60)))
      << "writes did not resume after the reconnect";
  stop.store(true);
  writer.join();
  EXPECT_EQ(ledger.unexpected, "");

  // Every block holds what was last acknowledged, or a write issued after it whose call failed.
  int checked = 0;
  std::vector<char> expected(kBlock);
  for (int block = 0; block < kBlocks; ++block) {
    CallOptions call;
    call.timeout = absl::Seconds(10);
    ASSERT_TRUE(c.Read("v", uint64_t(block) * kBlock, kBlock, &*buffer, nullptr, call).ok());
    std::set<uint64_t> allowed = ledger.unknown[block];
    allowed.insert(ledger.acked[block]);
    bool matched = false;
    for (uint64_t gen : allowed) {
      if (gen == 0) {
        expected.assign(kBlock, 0);
      } else {
        Fill(expected.data(), gen, block);
      }
      matched |= std::memcmp(buffer->data(), expected.data(), kBlock) == 0;
    }
    EXPECT_TRUE(matched) << "block " << block << " holds none of the generations it may hold (last"
                         << " acknowledged " << ledger.acked[block] << ", "
                         << ledger.unknown[block].size() << " failed after it)";
    ++checked;
  }
  EXPECT_EQ(checked, kBlocks);
}

}  // namespace
}  // namespace swirl::blockstore
