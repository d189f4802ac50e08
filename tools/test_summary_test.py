"""Tests of tools/test_summary.py against build event files from real Bazel 4.2.3 runs.

The fixtures in tools/testdata/test_summary were captured with capture.py there:
  * broken_binary: `bazel test --keep_going //bench/... //rpc:wire_test` with a line of garbage
    appended to bench/tcp_pingpong.cc (a cc_binary): its tests pass, Bazel exits 1.
  * keep_going_mix: a scratch package of one target per outcome (pass_test with a skip,
    fail_test, zero_test with no case, disabled_test with a DISABLED_ case, nobuild_test that
    built once and then did not (its old test.xml is still in testlogs), nobuild_bin, shard_test
    with two shards, runs_test run twice, sh_test, timeout_test, flaky_test that passed on its
    second attempt, crash_test that aborts after its cases passed) and a second package whose
    BUILD file does not load; Bazel exits 1.
Each test takes one of them, changes what the case needs (a subset of targets, an exit code, a
status, a file's age) and checks the summary's verdict.
"""

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SUMMARY = os.path.join(HERE, "test_summary.py")
FIXTURES = os.path.join(HERE, "testdata", "test_summary")
sys.path.insert(0, os.path.dirname(HERE))
from tools import junit  # noqa: E402

GREEN = ("//zzexp:pass_test", "//zzexp:sh_test", "//zzexp:shard_test", "//zzexp:runs_test")


def label_of(event):
    for value in event["id"].values():
        if isinstance(value, dict) and "label" in value:
            return value["label"]
    return None


class Fixture:
    """A copy of one captured run in a temporary directory, to change and summarize."""

    def __init__(self, name):
        self.dir = tempfile.mkdtemp(prefix="summary-")
        shutil.copytree(os.path.join(FIXTURES, name, "testlogs"),
                        os.path.join(self.dir, "testlogs"))
        shutil.copy(os.path.join(FIXTURES, name, "console.log"), self.dir)
        self.testlogs = os.path.join(self.dir, "testlogs")
        with open(os.path.join(FIXTURES, name, "bep.json")) as f:
            text = f.read().replace("@TESTLOGS@", self.testlogs)
        self.events = [json.loads(l) for l in text.splitlines() if l.strip()]
        # Each test.xml as old as its attempt (copying made them all new); any other file in
        # testlogs is a day older than the run, as an earlier run's would be.
        start = self.start_ms() / 1000.0
        for root, _, files in os.walk(self.testlogs):
            for f in files:
                os.utime(os.path.join(root, f), (start - 86400, start - 86400))
        for e in self.events:
            r = e.get("testResult")
            if r:
                t = (int(r["testAttemptStartMillisEpoch"]) +
                     int(r.get("testAttemptDurationMillis", 0))) / 1000.0
                for path in self.xml_paths(e):
                    os.utime(path, (t, t))
        self.exit_code = self.finished()["exitCode"].get("code", 0) if self.finished() else 0
        self.extra = None

    def start_ms(self):
        return int(next(e for e in self.events if "started" in e)["started"]["startTimeMillis"])

    def finished(self):
        for e in self.events:
            if "finished" in e:
                return e["finished"]
        return None

    @staticmethod
    def xml_paths(event):
        return [o["uri"][len("file://"):] for o in event["testResult"]["testActionOutput"]
                if o["name"] == "test.xml"]

    def keep_only(self, labels):
        """Drops every target-level event of other targets."""
        self.events = [e for e in self.events if label_of(e) is None or label_of(e) in labels]

    def results(self, label):
        return [e for e in self.events if "testResult" in e and label_of(e) == label]

    def set_exit(self, code):
        self.exit_code = code
        self.finished()["exitCode"] = {"code": code} if code else {}

    def with_extra(self, lines):
        self.extra = os.path.join(self.dir, "extra")
        with open(self.extra, "w") as f:
            f.write("".join(l + "\n" for l in lines))

    def run(self, *args, bazel_exit=None, bep_text=None, extra_exit=0, require_extra=True,
            bep=None):
        if bep is None:
            bep = os.path.join(self.dir, "bep.json")
            with open(bep, "w") as f:
                f.write(bep_text if bep_text is not None else
                        "".join(json.dumps(e) + "\n" for e in self.events))
        argv = [sys.executable, SUMMARY, "--bep", bep, "--log",
                os.path.join(self.dir, "console.log"), "--bazel-exit",
                str(self.exit_code if bazel_exit is None else bazel_exit)]
        if self.extra is not None:
            argv += ["--extra", self.extra, "--extra-exit", str(extra_exit)]
            if require_extra:
                argv += ["--require-extra", "embedding:make,embedding:bazel"]
        argv += list(args)
        p = subprocess.run(argv, capture_output=True, text=True)
        self.stderr = p.stderr
        return p.returncode, p.stdout

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)


class SummaryTest(unittest.TestCase):
    def fixture(self, name):
        f = Fixture(name)
        self.addCleanup(f.cleanup)
        return f

    def green(self):
        f = self.fixture("keep_going_mix")
        f.keep_only(GREEN)
        f.set_exit(0)
        return f

    def assertVerdict(self, result, rc, last_line=None):
        code, out = result
        self.assertEqual(code, rc, out)
        if last_line is not None:
            self.assertEqual(out.splitlines()[-1], last_line, out)
        return out

    # The green baseline every other case departs from: each shard's and each run's cases
    # count, the skip is listed with its reason.
    def test_a_green_run_counts_every_case_of_every_shard_and_run(self):
        out = self.assertVerdict(self.green().run(), 0, "12 passed, 0 failed, 1 skipped")
        self.assertIn("skipped: //zzexp:pass_test Good.Skips: no rdma-core device on this "
                      "machine", out)
        self.assertNotIn("FAILED", out)

    # Bazel's exit status: the entry point used to drop it.
    def test_a_non_test_target_that_does_not_build_fails_the_run(self):
        out = self.assertVerdict(self.fixture("broken_binary").run(), 1, "25 passed, 2 failed")
        self.assertIn("FAILED: //bench:tcp_pingpong (failed to build", out)
        self.assertIn("FAILED: bazel exited 1", out)
        self.assertIn("Compiling bench/tcp_pingpong.cc failed", out)

    def test_a_build_file_that_does_not_load_fails_the_run(self):
        f = self.fixture("keep_going_mix")
        f.keep_only(GREEN)  # the loading error leaves no target event: only the exit code
        out = self.assertVerdict(f.run(), 1)
        self.assertIn("bazel exited 1", out)
        self.assertIn("ERROR: package contains errors: zzexp2", out)

    def test_only_exit_codes_0_and_3_are_results(self):
        for code in (1, 2, 4, 8, 36, 37):
            f = self.green()
            f.set_exit(code)
            out = self.assertVerdict(f.run(), 1)
            self.assertIn("bazel exited %d" % code, out)

    def test_exit_3_needs_a_failed_test(self):
        f = self.green()
        f.set_exit(3)
        out = self.assertVerdict(f.run(), 1)
        self.assertIn("no failed test was found", out)

    def test_an_exit_code_the_event_file_contradicts_fails(self):
        out = self.assertVerdict(self.green().run(bazel_exit=3), 1)
        self.assertIn("bazel exited 3 but its build event file says 0", out)

    def test_an_event_file_without_build_finished_fails(self):
        f = self.green()
        f.events = [e for e in f.events if "finished" not in e]
        out = self.assertVerdict(f.run(), 1)
        self.assertIn("no buildFinished event", out)

    def test_a_missing_or_truncated_event_file_fails(self):
        f = self.green()
        out = self.assertVerdict(f.run(bep_text='{"id": {"started": {}}, "sta\n'), 1)
        self.assertIn("is not JSON", out)
        code, out = f.run(bep=os.path.join(f.dir, "nonexistent.json"))
        self.assertEqual(code, 1, out)
        self.assertIn("Bazel wrote no events", out)

    # Statuses.
    def test_failed_to_build_is_a_failure_and_its_stale_xml_is_not_read(self):
        f = self.fixture("keep_going_mix")
        f.keep_only(GREEN + ("//zzexp:nobuild_test",))
        f.set_exit(1)
        out = self.assertVerdict(f.run(bazel_exit=1), 1)
        self.assertIn("FAILED: //zzexp:nobuild_test (failed to build)", out)
        self.assertTrue(os.path.exists(os.path.join(f.testlogs, "zzexp/nobuild_test/test.xml")))
        self.assertNotIn("WasHereOnce", out)
        self.assertIn("12 passed, 2 failed", out)  # the target and Bazel's exit code

    def test_statuses_other_than_passed_and_flaky_fail_even_unknown_ones(self):
        for status in ("NO_STATUS", "INCOMPLETE", "REMOTE_FAILURE", "FAILED_TO_BUILD",
                       "TOOL_HALTED_BEFORE_TESTING", "BLAZE_HALTED_BEFORE_TESTING",
                       "A_STATUS_FROM_A_NEWER_BAZEL"):
            f = self.green()
            f.results("//zzexp:sh_test")[0]["testResult"]["status"] = status
            out = self.assertVerdict(f.run(), 1)
            self.assertIn("FAILED: //zzexp:sh_test (%s)" % status.lower().replace("_", " "), out)

    def test_a_timeout_fails(self):
        f = self.fixture("keep_going_mix")
        f.keep_only(GREEN + ("//zzexp:timeout_test",))
        f.set_exit(3)
        out = self.assertVerdict(f.run(), 1, "12 passed, 1 failed, 1 skipped")
        self.assertIn("FAILED: //zzexp:timeout_test", out)

    def test_a_test_that_crashes_after_its_cases_passed_fails(self):
        f = self.fixture("keep_going_mix")
        f.keep_only(GREEN + ("//zzexp:crash_test",))
        f.set_exit(3)
        out = self.assertVerdict(f.run(), 1, "14 passed, 1 failed, 1 skipped")
        self.assertIn("FAILED: //zzexp:crash_test (failed)", out)

    def test_a_failed_case_is_named(self):
        f = self.fixture("keep_going_mix")
        f.keep_only(GREEN + ("//zzexp:fail_test",))
        f.set_exit(3)
        out = self.assertVerdict(f.run(), 1, "13 passed, 1 failed, 1 skipped")
        self.assertIn("FAILED: //zzexp:fail_test A.Fail", out)

    def test_flaky_results_are_reported_as_flaky(self):
        f = self.fixture("keep_going_mix")
        f.keep_only(GREEN + ("//zzexp:flaky_test",))
        f.set_exit(0)
        out = self.assertVerdict(f.run(), 0, "13 passed, 0 failed, 1 skipped")
        self.assertIn("flaky: //zzexp:flaky_test passed on attempt 2 of 2", out)

    def test_a_failure_in_one_run_of_several_names_the_run(self):
        f = self.green()
        run2 = [e for e in f.results("//zzexp:runs_test") if e["id"]["testResult"]["run"] == 2]
        run2[0]["testResult"]["status"] = "FAILED"
        f.set_exit(3)
        out = self.assertVerdict(f.run(), 1)
        self.assertIn("FAILED: //zzexp:runs_test (run 2 of 2) (failed)", out)

    # test.xml.
    def test_a_zero_case_binary_fails(self):
        f = self.fixture("keep_going_mix")
        f.keep_only(GREEN + ("//zzexp:zero_test",))
        f.set_exit(0)
        out = self.assertVerdict(f.run(), 1)
        self.assertIn("FAILED: //zzexp:zero_test (its test.xml holds no test case", out)

    def test_disabled_cases_count_as_not_run(self):
        f = self.fixture("keep_going_mix")
        f.keep_only(GREEN + ("//zzexp:disabled_test",))
        f.set_exit(0)
        out = self.assertVerdict(f.run(), 0, "13 passed, 0 failed, 2 skipped")
        self.assertIn("skipped: //zzexp:disabled_test A.DISABLED_Off: not run: disabled", out)

    def test_a_stale_xml_is_not_counted_for_a_passing_result(self):
        f = self.green()
        path = Fixture.xml_paths(f.results("//zzexp:pass_test")[0])[0]
        old = f.start_ms() / 1000.0 - 3600
        os.utime(path, (old, old))
        out = self.assertVerdict(f.run(), 1)
        self.assertIn("FAILED: //zzexp:pass_test (passed; its test.xml is older than the test",
                      out)
        self.assertNotIn("Good.Skips", out)

    def test_a_passing_result_without_xml_fails(self):
        f = self.green()
        os.remove(Fixture.xml_paths(f.results("//zzexp:sh_test")[0])[0])
        out = self.assertVerdict(f.run(), 1)
        self.assertIn("FAILED: //zzexp:sh_test (passed, but it wrote no test.xml)", out)

    def test_a_test_target_without_any_result_fails(self):
        f = self.green()
        f.events = [e for e in f.events
                    if not ("testResult" in e and label_of(e) == "//zzexp:sh_test")]
        out = self.assertVerdict(f.run(), 1)
        self.assertIn("FAILED: //zzexp:sh_test (no status: it never ran)", out)

    def test_the_whole_mix(self):
        out = self.assertVerdict(self.fixture("keep_going_mix").run(), 1)
        failed = sorted(l for l in out.splitlines() if l.startswith("FAILED: //"))
        self.assertEqual(failed, [
            "FAILED: //zzexp:crash_test (failed)",
            "FAILED: //zzexp:fail_test A.Fail",
            "FAILED: //zzexp:nobuild_bin (failed to build: gcc failed: error executing "
            "command /usr/bin/gcc -U_FORTIFY_SOURCE -fstack-protector -Wall "
            "-Wunused-but-set-parameter -Wno-free-nonheap-object -fno-omit-frame-pointer "
            "'-std=c++0x' -MD -MF ... (remaining 23 argument(s) skipped))",
            "FAILED: //zzexp:nobuild_test (failed to build)",
            "FAILED: //zzexp:timeout_test zzexp/timeout_test",
            "FAILED: //zzexp:zero_test (its test.xml holds no test case: a test binary with no "
            "tests)",
        ])

    # Checks outside Bazel (the embedding check).
    def test_embedding_results_count(self):
        f = self.green()
        f.with_extra(["PASSED embedding:make", "PASSED embedding:bazel"])
        self.assertVerdict(f.run(), 0, "14 passed, 0 failed, 1 skipped")

    def test_a_vanished_embedding_result_fails(self):
        for lines in ([], ["PASSED embedding:make"], ["PASSED embedding:bazel"]):
            f = self.green()
            f.with_extra(lines)
            out = self.assertVerdict(f.run(), 1)
            self.assertIn("(no result: the check did not report one)", out)
        f = self.green()
        f.with_extra([])
        os.remove(f.extra)
        self.assertVerdict(f.run(), 1)

    def test_a_skipped_embedding_check_says_why(self):
        f = self.green()
        f.with_extra(["SKIPPED embedding:make SWIRL_SKIP_EMBEDDING=1 in the environment",
                      "SKIPPED embedding:bazel SWIRL_SKIP_EMBEDDING=1 in the environment"])
        out = self.assertVerdict(f.run(), 0, "12 passed, 0 failed, 3 skipped")
        self.assertIn("skipped: embedding:make: SWIRL_SKIP_EMBEDDING=1 in the environment", out)

    def test_a_failing_or_silent_embedding_check_fails(self):
        f = self.green()
        f.with_extra(["FAILED embedding:make", "PASSED embedding:bazel"])
        out = self.assertVerdict(f.run(extra_exit=1), 1)
        self.assertIn("FAILED: embedding:make", out)
        f = self.green()
        f.with_extra(["PASSED embedding:make", "PASSED embedding:bazel"])
        out = self.assertVerdict(f.run(extra_exit=2), 1)
        self.assertIn("exited 2 without reporting a failure", out)
        f = self.green()
        f.with_extra(["PASSED embedding:make", "PASSED embedding:bazel", "garbage"])
        out = self.assertVerdict(f.run(), 1)
        self.assertIn("malformed result line", out)

    # Expected skips.
    def expected_skips(self, f, lines):
        path = os.path.join(f.dir, "skips")
        with open(path, "w") as out:
            out.write("# comment\n\n" + "".join(l + "\n" for l in lines))
        return path

    def test_an_unexpected_skip_fails_where_skips_are_enforced(self):
        f = self.green()
        self.assertVerdict(f.run("--expected-skips", self.expected_skips(f, []),
                                 "--enforce-skips"), 1)
        out = f.run("--expected-skips", self.expected_skips(f, []), "--enforce-skips")[1]
        self.assertIn("FAILED: //zzexp:pass_test Good.Skips (skipped, and no line of the "
                      "expected skips allows it", out)
        # Not enforced (a host with real devices, where other skips are normal): listed only.
        self.assertVerdict(f.run("--expected-skips", self.expected_skips(f, [])), 0)

    def test_an_expected_skip_passes_only_with_its_reason(self):
        f = self.green()
        good = self.expected_skips(f, ["//zzexp:pass_test Good.Skips\tno rdma-core device"])
        self.assertVerdict(f.run("--expected-skips", good, "--enforce-skips"), 0)
        wrong = self.expected_skips(f, ["//zzexp:pass_test Good.Skips\tsome other reason"])
        self.assertVerdict(f.run("--expected-skips", wrong, "--enforce-skips"), 1)

    def test_an_expected_skip_line_may_name_tests_by_a_glob(self):
        f = self.green()
        glob = self.expected_skips(f, ["//zzexp:pass_test Good.*\tno rdma-core device"])
        self.assertVerdict(f.run("--expected-skips", glob, "--enforce-skips"), 0)
        other = self.expected_skips(f, ["//zzexp:other_test *\tno rdma-core device"])
        self.assertVerdict(f.run("--expected-skips", other, "--enforce-skips"), 1)

    def test_a_disabled_case_is_an_unexpected_skip(self):
        f = self.fixture("keep_going_mix")
        f.keep_only(GREEN + ("//zzexp:disabled_test",))
        f.set_exit(0)
        skips = self.expected_skips(f, ["//zzexp:pass_test Good.Skips\tno rdma-core device"])
        out = self.assertVerdict(f.run("--expected-skips", skips, "--enforce-skips"), 1)
        self.assertIn("FAILED: //zzexp:disabled_test A.DISABLED_Off (skipped", out)

    def test_a_malformed_expected_skips_file_fails(self):
        f = self.green()
        bad = self.expected_skips(f, ["no tab here"])
        self.assertVerdict(f.run("--expected-skips", bad), 1)

    # Several runs (`./swirl test --sanitizers`: the suite under asan, then under tsan) and what
    # a run leaves out (tools/sanitizer_exclusions.txt).
    def run_many(self, runs, *args):
        argv = [sys.executable, SUMMARY]
        for name, f in runs:
            bep = os.path.join(f.dir, "bep.json")
            with open(bep, "w") as out:
                out.write("".join(json.dumps(e) + "\n" for e in f.events))
            argv += ["--bep", bep, "--bazel-exit", str(f.exit_code), "--log",
                     os.path.join(f.dir, "console.log"), "--run", name]
        p = subprocess.run(argv + list(args), capture_output=True, text=True)
        return p.returncode, p.stdout

    def exclusions(self, f, lines):
        path = os.path.join(f.dir, "exclusions")
        with open(path, "w") as out:
            out.write("# comment\n\n" + "".join(l + "\n" for l in lines))
        return path

    def test_several_runs_are_each_counted_under_their_name_and_added_up(self):
        out = self.assertVerdict(self.run_many([("asan", self.green()), ("tsan", self.green())]),
                                 0, "24 passed, 0 failed, 2 skipped")
        self.assertIn("== asan: 12 passed, 0 failed, 1 skipped", out)
        self.assertIn("== tsan: 12 passed, 0 failed, 1 skipped", out)

    def test_a_failure_in_one_of_several_runs_fails_the_whole_and_is_shown_under_it(self):
        broken = self.fixture("broken_binary")
        out = self.assertVerdict(self.run_many([("asan", self.green()), ("tsan", broken)]), 1,
                                 "37 passed, 2 failed, 1 skipped")
        tsan = out.split("== tsan:", 1)[1]
        self.assertIn("FAILED: //bench:tcp_pingpong (failed to build", tsan)
        self.assertNotIn("FAILED", out.split("== tsan:", 1)[0])
        # A run whose Bazel wrote no events is not a pass, whatever the other run did.
        f = self.green()
        gone = self.green()
        gone.events = []
        out = self.assertVerdict(self.run_many([("asan", f), ("tsan", gone)]), 1)
        self.assertIn("no buildFinished event", out.split("== tsan:", 1)[1])

    def test_an_exclusion_is_printed_with_its_reason_and_counted(self):
        f = self.green()
        f.keep_only(tuple(l for l in GREEN if l != "//zzexp:sh_test"))
        path = self.exclusions(f, ["asan,tsan\t//zzexp:sh_test\tloads an uninstrumented "
                                   "library first", "tsan\t//zzexp:pass_test\tnot here"])
        out = self.assertVerdict(f.run("--run", "asan", "--excluded", path), 0,
                                 "11 passed, 0 failed, 1 skipped, 1 excluded")
        self.assertIn("excluded: //zzexp:sh_test: loads an uninstrumented library first", out)
        self.assertNotIn("not here", out)  # a line for another run

    def test_an_excluded_target_that_ran_anyway_fails(self):
        f = self.green()
        path = self.exclusions(f, ["asan\t//zzexp:sh_test\tsome reason"])
        out = self.assertVerdict(f.run("--run", "asan", "--excluded", path), 1)
        self.assertIn("FAILED: //zzexp:sh_test (listed in %s as excluded under asan, but it "
                      "ran)" % path, out)

    def test_a_check_not_run_must_be_excluded_with_a_reason(self):
        f = self.green()
        path = self.exclusions(f, ["asan\tfuzz:*\talready ASan+UBSan (--config=fuzz)"])
        out = self.assertVerdict(
            f.run("--run", "asan", "--excluded", path, "--not-run", "fuzz:a_fuzzer,fuzz:b_fuzzer"),
            0, "12 passed, 0 failed, 1 skipped, 2 excluded")
        self.assertIn("excluded: fuzz:a_fuzzer: already ASan+UBSan (--config=fuzz)", out)
        out = self.assertVerdict(
            f.run("--run", "asan", "--excluded", path, "--not-run", "fuzz:a_fuzzer,embedding:make"),
            1)
        self.assertIn("FAILED: embedding:make (not run under asan, and %s does not say why)" %
                      path, out)
        bad = self.exclusions(f, ["asan //zzexp:sh_test no tabs"])
        self.assertVerdict(f.run("--run", "asan", "--excluded", bad), 1)

    def test_nothing_run_is_not_a_pass(self):
        f = self.green()
        f.keep_only(())
        out = self.assertVerdict(f.run(), 1)
        self.assertIn("no test ran", out)


class EntryPointTest(unittest.TestCase):
    """`./swirl test` itself, with a stand-in `bazel` that replays a fixture and exits as told:
    the entry point must pass Bazel's exit status and event file to the summary, and exit
    non-zero when the summary finds a failure (it used to drop Bazel's status)."""

    SWIRL = os.path.join(HERE, "..", "swirl")

    def swirl_test(self, fixture, bazel_exit, write_events=True, args=()):
        bep = os.path.join(fixture.dir, "replayed.json")
        with open(bep, "w") as f:
            f.write("".join(json.dumps(e) + "\n" for e in fixture.events))
        bindir = os.path.join(fixture.dir, "bin")
        os.makedirs(bindir, exist_ok=True)
        fake = os.path.join(bindir, "bazel")
        if os.path.exists(fake + ".calls"):
            os.remove(fake + ".calls")
        with open(fake, "w") as f:
            f.write("#!/bin/sh\n"
                    "# Replays a captured run: copies its events to --build_event_json_file.\n"
                    "echo \"$*\" >>\"$0.calls\"\n"
                    "for a in \"$@\"; do case \"$a\" in --build_event_json_file=*)\n"
                    "  %s; esac; done\n"
                    "echo '//zzexp:sh_test    PASSED in 0.0s'\n"
                    "exit %d\n" % ('cp "%s" "${a#*=}"' % bep if write_events else ":",
                                    bazel_exit))
        os.chmod(fake, 0o755)
        env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""),
                   SWIRL_SKIP_EMBEDDING="1", SWIRL_SKIP_FUZZ="1")
        p = subprocess.run(["bash", self.SWIRL, "test"] + list(args), capture_output=True,
                           text=True, env=env)
        self.calls = []
        if os.path.exists(fake + ".calls"):
            with open(fake + ".calls") as f:
                self.calls = f.read().splitlines()
        return p.returncode, p.stdout + p.stderr

    def fixture(self, name, labels=None, exit_code=None):
        f = Fixture(name)
        self.addCleanup(f.cleanup)
        if labels is not None:
            f.keep_only(labels)
        if exit_code is not None:
            f.set_exit(exit_code)
        return f

    def test_a_green_run_exits_zero(self):
        f = self.fixture("keep_going_mix", GREEN[1:], 0)
        code, out = self.swirl_test(f, 0)
        self.assertEqual(code, 0, out)
        # 2 embedding checks and the 5 fuzz targets, skipped by name and with the reason.
        self.assertEqual(out.splitlines()[-1], "10 passed, 0 failed, 7 skipped", out)
        self.assertIn("skipped: embedding:make: SWIRL_SKIP_EMBEDDING=1", out)
        self.assertIn("skipped: fuzz:rpc_wire_fuzzer: SWIRL_SKIP_FUZZ=1", out)

    def test_a_tree_that_does_not_build_exits_non_zero(self):
        code, out = self.swirl_test(self.fixture("broken_binary"), 1)
        self.assertNotEqual(code, 0, out)
        self.assertEqual(out.splitlines()[-1], "25 passed, 2 failed, 7 skipped", out)

    def test_a_bazel_that_wrote_no_events_exits_non_zero(self):
        code, out = self.swirl_test(self.fixture("keep_going_mix", GREEN[1:], 0), 0,
                                    write_events=False)
        self.assertNotEqual(code, 0, out)
        self.assertIn("Bazel wrote no events", out)

    # ./swirl test --sanitizers: one Bazel run per sanitizer, without the listed exclusions.
    def test_sanitizers_run_the_suite_under_each_without_the_listed_exclusions(self):
        f = self.fixture("keep_going_mix", GREEN[1:], 0)
        code, out = self.swirl_test(f, 0, args=["--sanitizers", "--test_filter=X"])
        self.assertEqual(code, 0, out)
        self.assertEqual(len(self.calls), 2, self.calls)
        asan, tsan = self.calls
        self.assertIn("--config=asan", asan)
        self.assertIn("--config=tsan", tsan)
        self.assertNotIn("--sanitizers", asan + tsan)
        self.assertIn("--test_filter=X", asan)
        with open(os.path.join(HERE, "sanitizer_exclusions.txt")) as listed:
            lines = [l.rstrip("\n").split("\t") for l in listed
                     if l.strip() and not l.startswith("#")]
        for configs, target, reason in lines:
            for name, call in (("asan", asan), ("tsan", tsan)):
                if target.startswith("//"):
                    self.assertEqual(" -" + target in call, name in configs.split(","), call)
                if name in configs.split(","):
                    self.assertIn("excluded: ", out)
                    self.assertIn(reason, out)
        self.assertIn(" -- //...", asan)
        last = out.splitlines()[-1]
        self.assertRegex(last, r"^20 passed, 0 failed, \d+ excluded$", out)
        self.assertIn("== asan: 10 passed", out)
        self.assertIn("== tsan: 10 passed", out)
        # Every check outside Bazel is excluded by name under each sanitizer, with a reason.
        self.assertIn("excluded: embedding:make: ", out)
        self.assertIn("excluded: fuzz:rpc_wire_fuzzer: ", out)

    def test_one_sanitizer_and_a_failing_run(self):
        f = self.fixture("keep_going_mix", GREEN[1:], 0)
        code, out = self.swirl_test(f, 0, args=["--sanitizers=tsan"])
        self.assertEqual(code, 0, out)
        self.assertEqual(len(self.calls), 1, self.calls)
        self.assertIn("--config=tsan", self.calls[0])
        self.assertRegex(out.splitlines()[-1], r"^10 passed, 0 failed, \d+ excluded$")
        code, out = self.swirl_test(self.fixture("broken_binary"), 1, args=["--sanitizers=asan"])
        self.assertNotEqual(code, 0, out)
        self.assertRegex(out.splitlines()[-1], r"^25 passed, 2 failed, \d+ excluded$")
        code, out = self.swirl_test(f, 0, args=["--sanitizers=msan"])
        self.assertEqual(code, 2, out)
        self.assertIn("--sanitizers takes asan, tsan", out)


if __name__ == "__main__":
    junit.main()
