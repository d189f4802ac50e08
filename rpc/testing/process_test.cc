// ChildProcess ends its children honestly: a child that crashes or fails at its end fails the
// test that owned it, and only Kill() ends one without judging it.

#include "rpc/testing/process.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace swirl::testing {
namespace {

// A shell child that does `on_term` when SIGTERM arrives and otherwise waits; returned once its
// trap is set (it says so by creating a file), so the test's SIGTERM meets the trap.
ChildProcess Shell(const std::string& on_term) {
  static int serial = 0;
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string ready =
      absl::StrCat(tmp ? tmp : "/tmp", "/shell-ready-", getpid(), "-", ++serial);
  auto child = ChildProcess::Spawn({"/bin/sh", "-c",
                                    "trap '" + on_term + "' TERM; : > '" + ready +
                                        "'; while :; do sleep 0.01; done"});
  EXPECT_TRUE(child.ok()) << child.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (access(ready.c_str(), F_OK) != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  EXPECT_EQ(access(ready.c_str(), F_OK), 0) << "the shell never set its trap";
  return std::move(*child);
}

TEST(ChildProcess, AChildThatExitsCleanlyOnSigtermPasses) {
  ChildProcess child = Shell("exit 0");
}

// StopAndWait returns once the child is really stopped, and the child runs on after SIGCONT.
TEST(ChildProcess, StopAndWaitReturnsOnceTheChildIsStopped) {
  ChildProcess child = Shell("exit 0");
  ASSERT_TRUE(child.StopAndWait().ok());
  std::ifstream in(absl::StrCat("/proc/", child.pid(), "/stat"));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = stat.rfind(')');
  ASSERT_NE(paren, std::string::npos);
  EXPECT_EQ(stat[paren + 2], 'T') << stat;
  child.Signal(SIGCONT);
}

TEST(ChildProcess, AChildThatCrashesAtItsEndFailsTheTest) {
  EXPECT_NONFATAL_FAILURE(
      {
        ChildProcess child = Shell("kill -SEGV $$");
      },
      "ended abnormally: signal 11");
}

TEST(ChildProcess, AChildThatFailsAtItsEndFailsTheTest) {
  EXPECT_NONFATAL_FAILURE(
      {
        ChildProcess child = Shell("exit 23");  // as LeakSanitizer's exit status would
      },
      "ended abnormally: exit status 23");
}

TEST(ChildProcess, AChildThatIgnoresSigtermIsKilledAndFailsTheTest) {
  EXPECT_NONFATAL_FAILURE(
      {
        ChildProcess child = Shell("");
        child.set_stop_timeout(absl::Milliseconds(300));
      },
      "did not exit within 300ms of SIGTERM and was killed");
}

TEST(ChildProcess, KillIsForTestsThatMeanToKill) {
  ChildProcess child = Shell("exit 0");
  child.Kill();
  EXPECT_EQ(child.pid(), -1);
}

TEST(ChildProcess, AnExitTheTestWaitedForIsTheTestsToJudge) {
  ChildProcess child = Shell("exit 7");
  absl::StatusOr<int> code = child.Stop(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 7);
}

}  // namespace
}  // namespace swirl::testing
