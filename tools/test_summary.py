#!/usr/bin/env python3
"""swirl's test summary: what `./swirl test` ran, read from Bazel's Build Event Protocol.

Usage:
  test_summary.py --bep FILE --bazel-exit N [--log FILE] [--run NAME]
                  [--bep FILE --bazel-exit N [--log FILE] --run NAME ...]
                  [--extra FILE --extra-exit N --require-extra NAME,NAME...]
                  [--expected-skips FILE [--enforce-skips]]
                  [--excluded FILE [--not-run NAME,NAME...]]

It prints the skipped and failed cases, then one last line, "N passed, N failed[, N skipped]
[, N excluded]",
and exits 1 unless the run is a success: nothing failed, nothing is unaccounted for.

Why the build event file and not Bazel's console: the console lists only test targets, so a
non-test target that failed to build (a benchmark, a tool, the generated-code check) or a BUILD
file that failed to load left no trace there; it cannot tell this run's test.xml from one an
earlier run left behind; and its status words are free text. The event file names every target
with its outcome, every test attempt, shard and run with the exact test.xml it wrote, and the
exit code Bazel ended with.

Rules (each has a fixture case in tools/test_summary_test.py):
  * Bazel's exit code must be 0, or 3 ("some tests failed") with a failed test to show for it;
    it must agree with the event file's buildFinished; a file without buildFinished (Bazel
    crashed or was killed) is a failure.
  * Every configured target must complete; a failed one counts as a failure of its own, test
    target or not. A test target without a test result (it failed to build, or the build
    halted first) counts as one failure. So do aborted events (loading, analysis).
  * Only PASSED and FLAKY are successes among Bazel's test statuses; any other status,
    including one this script does not know, fails the target.
  * Every case in each result's test.xml counts: failures and errors fail, skips are listed
    with their reason, DISABLED_ cases count as not run (skipped, with that reason). A test.xml
    older than its attempt (not written by it) fails the target, and so does one with no case
    at all (a gtest binary with zero tests), or none where one was promised. A target whose
    status failed while all its cases passed (it crashed at exit, a sanitizer failed it, it
    timed out) counts as one failure of its own.
  * FLAKY results are counted by their passing attempt and listed as flaky.
  * Results of checks outside Bazel (--extra; tools/embedding_check.sh writes them) are lines
    "PASSED name", "FAILED name" or "SKIPPED name reason" (a skip the user asked for, listed
    with its reason and not judged by the expected skips). Each --require-extra name must have
    a line; the script that wrote them must have exited 0 unless it reported a failure.
  * --expected-skips lists the skips this kind of host may have: lines "TEST<TAB>REASON", TEST
    the label and case ("//pkg:target Suite.Case", or a glob over them: a suite that judges
    its own skips, as the rdma-core suite does against its expected results) and REASON a
    regular expression the skip's reason must match. With --enforce-skips (`./swirl test` passes it where the only RDMA
    device is soft0) a skip that no line allows is a failure: a test that quietly decided it
    could not run is not a pass.
  * Several runs (`./swirl test --sanitizers`: the suite under --config=asan, then under
    --config=tsan): --bep, --bazel-exit, --log and --run once each per run. Each run is judged
    by every rule above on its own and printed under its name with its own counts; the last
    line adds them up.
  * --excluded lists what a named run leaves out, each with its reason: lines
    "CONFIGS<TAB>TARGET<TAB>REASON", CONFIGS the runs it applies to ("asan,tsan"), TARGET a
    Bazel label (the entry point gives it to Bazel as a negative pattern) or a glob over the
    checks outside Bazel ("fuzz:*"). Every exclusion is printed with its reason and counted
    ("N excluded" on the last line); an excluded label that ran anyway fails, and so does a
    check outside Bazel in --not-run that no line of its run excludes.
"""

import argparse
import fnmatch
import json
import os
import re
import sys
import urllib.parse
import xml.etree.ElementTree as ET

SUCCESS_EXIT_CODES = (0, 3)  # 3: the build succeeded and some tests failed
PASSING_STATUSES = ("PASSED", "FLAKY")
XML_SLACK_SECONDS = 2.0  # file system timestamps against Bazel's clock


class Summary:
    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.skipped = 0
        self.failures = []  # text for each failure line
        self.skips = []  # (test name, reason)
        self.chosen_skips = set()  # names the user chose to skip (not judged by the list)
        self.notes = []  # flaky results and other lines worth reading
        self.excluded = []  # (target, reason): left out of this run by a listed exclusion

    def fail(self, text):
        self.failed += 1
        self.failures.append(text)


def uri_path(uri):
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("", "file"):
        return None
    return urllib.parse.unquote(parsed.path)


def read_bep(path, summary):
    """The event file's events, or None (and a failure) if it cannot be read."""
    events = []
    try:
        with open(path, errors="replace") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    events.append(json.loads(line))
                except ValueError:
                    summary.fail("build event file %s: line %d is not JSON (truncated?)" %
                                 (path, n))
    except OSError as e:
        summary.fail("build event file %s: %s (Bazel wrote no events)" % (path, e.strerror))
        return None
    return events


def case_name(label, case, suffix):
    classname = case.get("classname")
    name = case.get("name") or "(unnamed)"
    full = "%s.%s" % (classname, name) if classname else name
    return "%s %s%s" % (label, full, suffix)


def skip_reason(case):
    node = case.find("skipped")
    reason = ""
    if node is not None:
        reason = (node.get("message") or node.text or "").strip()
    # gtest puts the source location first and the streamed message last.
    return reason.splitlines()[-1].strip() if reason else "(no reason given)"


def count_xml(summary, label, xml_path, suffix):
    """Counts the cases of one test.xml. Returns (cases, failed cases), or None if unreadable."""
    try:
        root = ET.parse(xml_path).getroot()
    except (ET.ParseError, OSError) as e:
        summary.fail("%s%s (test.xml unreadable: %s)" % (label, suffix, e))
        return None
    cases = failed = 0
    for case in root.iter("testcase"):
        cases += 1
        name = case_name(label, case, suffix)
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            summary.fail(name)
        elif case.get("status") == "notrun" or case.get("result") == "suppressed":
            summary.skipped += 1
            summary.skips.append((name, "not run: disabled (DISABLED_ prefix)"))
        elif case.get("result") == "skipped" or case.find("skipped") is not None:
            summary.skipped += 1
            summary.skips.append((name, skip_reason(case)))
        else:
            summary.passed += 1
    return cases, failed


def output_file(result, name):
    for out in result.get("testActionOutput", []):
        if out.get("name") == name:
            return uri_path(out.get("uri", ""))
    return None


def count_result(summary, label, key, result, suffix):
    """One test attempt (a run of a shard): its status and its test.xml."""
    status = result.get("status", "NO_STATUS")
    xml_path = output_file(result, "test.xml")
    where = "%s%s" % (label, suffix)
    counted = None
    if xml_path is None or not os.path.exists(xml_path):
        if status in PASSING_STATUSES:
            summary.fail("%s (%s, but it wrote no test.xml)" % (where, status.lower()))
            return
    else:
        start_ms = int(result.get("testAttemptStartMillisEpoch", "0") or 0)
        fresh = (result.get("cachedLocally") or start_ms == 0 or
                 os.path.getmtime(xml_path) >= start_ms / 1000.0 - XML_SLACK_SECONDS)
        if not fresh:
            summary.fail("%s (%s; its test.xml is older than the test: an earlier run's, not "
                         "counted)" % (where, status.lower()))
            return
        counted = count_xml(summary, label, xml_path, suffix)
        if counted is None:
            return
        if counted[0] == 0:
            summary.fail("%s (its test.xml holds no test case: a test binary with no tests)" %
                         where)
            return
    if status not in PASSING_STATUSES and (counted is None or counted[1] == 0):
        summary.fail("%s (%s)" % (where, status.lower().replace("_", " ")))


def run_suffix(key, shards, runs):
    parts = []
    if runs.get(key[0], 1) > 1:
        parts.append("run %d of %d" % (key[1], runs[key[0]]))
    if shards.get(key[0], 1) > 1:
        parts.append("shard %d of %d" % (key[2], shards[key[0]]))
    return " (%s)" % ", ".join(parts) if parts else ""


def summarize_bazel(summary, events, bazel_exit, log_path):
    kinds = {}  # label -> target kind, from targetConfigured
    completed = {}  # label -> (success, failure message)
    attempts = {}  # (label, run, shard) -> [(attempt, result)]
    overall = {}  # label -> testSummary's overallStatus
    finished_code = None
    for e in events:
        eid = e.get("id", {})
        if "targetConfigured" in eid and "configured" in e:
            kinds[eid["targetConfigured"]["label"]] = e["configured"].get("targetKind", "")
        elif "targetCompleted" in eid and "completed" in e:
            done = e["completed"]
            message = (done.get("failureDetail") or {}).get("message", "")
            completed[eid["targetCompleted"]["label"]] = (bool(done.get("success")), message)
        elif "testResult" in eid and "testResult" in e:
            t = eid["testResult"]
            key = (t["label"], int(t.get("run", 1)), int(t.get("shard", 1)))
            attempts.setdefault(key, []).append((int(t.get("attempt", 1)), e["testResult"]))
        elif "testSummary" in eid and "testSummary" in e:
            overall[eid["testSummary"]["label"]] = e["testSummary"].get("overallStatus", "")
        elif "buildFinished" in eid and "finished" in e:
            finished_code = int(e["finished"].get("exitCode", {}).get("code", 0))
        if "aborted" in e:
            a = e["aborted"]
            summary.fail("bazel aborted %s: %s %s" % (json.dumps(eid, sort_keys=True),
                                                      a.get("reason", ""),
                                                      a.get("description", "")))

    if finished_code is None:
        summary.fail("bazel did not finish (no buildFinished event): it crashed or was killed")
    elif finished_code != bazel_exit:
        summary.fail("bazel exited %d but its build event file says %d" %
                     (bazel_exit, finished_code))
    if bazel_exit not in SUCCESS_EXIT_CODES:
        errors = []
        if log_path and os.path.exists(log_path):
            with open(log_path, errors="replace") as f:
                errors = [l.rstrip() for l in f if l.startswith("ERROR: ")]
        summary.fail("bazel exited %d (a build, loading or command failure; only 0, or 3 for "
                     "failed tests, are results)%s" %
                     (bazel_exit, "".join("\n    " + l for l in errors[:20])))

    test_labels = sorted(l for l, k in kinds.items() if k.endswith("_test rule") or
                         k == "test_suite rule")
    for label in sorted(set(kinds) | set(completed)):
        success, message = completed.get(label, (None, ""))
        if success is None:
            summary.fail("%s (never completed: the build stopped first)" % label)
        elif not success and label not in test_labels:
            summary.fail("%s (failed to build%s)" % (label, ": " + message.splitlines()[0]
                                                     if message else ""))

    shards, runs = {}, {}
    for (label, run, shard) in attempts:
        shards[label] = max(shards.get(label, 1), shard)
        runs[label] = max(runs.get(label, 1), run)
    with_results = {key[0] for key in attempts}
    for label in test_labels:
        if label not in with_results:
            success, message = completed.get(label, (None, ""))
            why = "failed to build" if success is False else "no status: it never ran"
            summary.fail("%s (%s)" % (label, why))
    for key in sorted(attempts):
        tries = sorted(attempts[key], key=lambda a: a[0])
        suffix = run_suffix(key, shards, runs)
        if len(tries) > 1:
            summary.notes.append("flaky: %s%s passed on attempt %d of %d (earlier attempts "
                                 "failed)" % (key[0], suffix, tries[-1][0], len(tries)))
        count_result(summary, key[0], key, tries[-1][1], suffix)
    for label, status in sorted(overall.items()):
        if status == "FLAKY" and not any(n.startswith("flaky: " + label) for n in summary.notes):
            summary.notes.append("flaky: %s" % label)

    if bazel_exit == 3 and summary.failed == 0:
        summary.fail("bazel exited 3 (tests failed) but no failed test was found in its events")


def summarize_extra(summary, path, exit_code, required):
    """Results of checks outside Bazel."""
    seen = set()
    reported_failure = False
    lines = []
    if path and os.path.exists(path):
        with open(path, errors="replace") as f:
            lines = f.readlines()
    for line in lines:
        parts = line.split(None, 2)
        if not parts:
            continue
        if len(parts) >= 2 and parts[0] in ("PASSED", "FAILED"):
            name = parts[1].strip()
            seen.add(name)
            if parts[0] == "PASSED":
                summary.passed += 1
            else:
                reported_failure = True
                summary.fail(name)
        elif len(parts) == 3 and parts[0] == "SKIPPED":
            seen.add(parts[1])
            summary.chosen_skips.add(parts[1])
            summary.skipped += 1
            summary.skips.append((parts[1], parts[2].strip()))
        else:
            reported_failure = True
            summary.fail("%s: malformed result line %r" % (path, line.strip()))
    for name in required:
        if name not in seen:
            summary.fail("%s (no result: the check did not report one)" % name)
    if exit_code not in (None, 0) and not reported_failure:
        summary.fail("the checks outside Bazel exited %d without reporting a failure" %
                     exit_code)


def read_expected_skips(path, summary):
    allowed = []
    with open(path, errors="replace") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            test, sep, reason = line.partition("\t")
            if not sep:
                summary.fail("%s:%d: not TEST<TAB>REASON" % (path, n))
                continue
            try:
                allowed.append((test.strip(), re.compile(reason.strip())))
            except re.error as e:
                summary.fail("%s:%d: bad reason pattern: %s" % (path, n, e))
    return allowed


def check_skips(summary, allowed, enforce):
    for name, reason in summary.skips:
        if name in summary.chosen_skips:
            continue  # e.g. SWIRL_SKIP_EMBEDDING=1: the user's choice, printed with its reason
        ok = any(fnmatch.fnmatchcase(name, test) and pattern.search(reason)
                 for test, pattern in allowed)
        if enforce and not ok:
            summary.fail("%s (skipped, and no line of the expected skips allows it: %s)" %
                         (name, reason))


def read_exclusions(path, summary):
    """The exclusions file's lines: [(configs, target, reason)]."""
    lines = []
    with open(path, errors="replace") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            parts = [p.strip() for p in line.split("\t")]
            if len(parts) != 3 or not all(parts):
                summary.fail("%s:%d: not CONFIGS<TAB>TARGET<TAB>REASON" % (path, n))
                continue
            lines.append((set(parts[0].split(",")), parts[1], parts[2]))
    return lines


def check_exclusions(summary, events, exclusions, run, path, not_run):
    """What this run left out: each target of `exclusions` listed for `run` (Bazel was given
    them as negative patterns) and each check outside Bazel in `not_run`, which must match a
    line for this run. An excluded target that ran anyway is a failure: the list says it
    does not run here."""
    mine = [(target, reason) for configs, target, reason in exclusions if run in configs]
    ran = set()
    for e in events or []:
        label = label_of(e)
        if label is not None and "testResult" in e.get("id", {}):
            ran.add(label)
    for target, reason in mine:
        if target.startswith("//"):
            if target in ran:
                summary.fail("%s (listed in %s as excluded under %s, but it ran)" %
                             (target, path, run))
            else:
                summary.excluded.append((target, reason))
    for name in not_run:
        reason = next((r for t, r in mine if not t.startswith("//") and
                       fnmatch.fnmatchcase(name, t)), None)
        if reason is None:
            summary.fail("%s (not run under %s, and %s does not say why)" % (name, run, path))
        else:
            summary.excluded.append((name, reason))


def label_of(event):
    for value in event.get("id", {}).values():
        if isinstance(value, dict) and "label" in value:
            return value["label"]
    return None


def counts_line(summary):
    line = "%d passed, %d failed" % (summary.passed, summary.failed)
    if summary.skipped:
        line += ", %d skipped" % summary.skipped
    if summary.excluded:
        line += ", %d excluded" % len(summary.excluded)
    return line


def print_summary(summary):
    # Skips by target and reason: one line for a lone case, one line per reason for many (the
    # rdma-core suite skips ~200 tests of hardware soft0 is not).
    groups = {}
    for name, reason in summary.skips:
        groups.setdefault((name.split(" ", 1)[0], reason), []).append(name)
    for (label, reason), names in groups.items():
        if len(names) == 1:
            print("skipped: %s: %s" % (names[0], reason))
        else:
            print("skipped: %s: %d cases: %s" % (label, len(names), reason))
    for name, reason in summary.excluded:
        print("excluded: %s: %s" % (name, reason))
    for note in summary.notes:
        print(note)
    for f in summary.failures:
        print("FAILED: " + f)


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bep", required=True, action="append",
                   help="Bazel's --build_event_json_file (once per run)")
    p.add_argument("--bazel-exit", type=int, required=True, action="append",
                   help="Bazel's exit code (once per run)")
    p.add_argument("--log", action="append",
                   help="Bazel's console output, for its ERROR lines (once per run)")
    p.add_argument("--run", action="append",
                   help="the run's name, the configuration it selects in --excluded (once "
                   "per run; needed with several runs)")
    p.add_argument("--extra", help="results of checks outside Bazel")
    p.add_argument("--extra-exit", type=int, help="exit code of the script that wrote --extra")
    p.add_argument("--require-extra", default="", help="comma-separated names --extra must hold")
    p.add_argument("--expected-skips", help="TEST<TAB>REASON lines")
    p.add_argument("--enforce-skips", action="store_true",
                   help="fail on a skip no expected-skips line allows")
    p.add_argument("--excluded", help="CONFIGS<TAB>TARGET<TAB>REASON lines: what a run left out")
    p.add_argument("--excluded-name", help="what to call --excluded in messages (the file it "
                   "was filtered from)")
    p.add_argument("--not-run", default="",
                   help="comma-separated checks outside Bazel these runs did not run: each "
                   "must be excluded for each run")
    args = p.parse_args(argv)
    runs = len(args.bep)
    logs = args.log or []
    names = args.run or []
    if len(args.bazel_exit) != runs or len(logs) not in (0, runs) or \
            len(names) not in (0, runs) or (runs > 1 and not names) or \
            (args.excluded and not names):
        p.error("--bep, --bazel-exit, --log and --run go together, once per run (and --run "
                "is needed with several runs or with --excluded)")

    total = Summary()
    summaries = []
    for i in range(runs):
        summary = Summary()
        events = read_bep(args.bep[i], summary)
        if events is not None:
            summarize_bazel(summary, events, args.bazel_exit[i], logs[i] if logs else None)
        if args.excluded:
            exclusions = read_exclusions(args.excluded, summary)
            check_exclusions(summary, events, exclusions, names[i],
                             args.excluded_name or args.excluded,
                             [n for n in args.not_run.split(",") if n])
        required = [n for n in args.require_extra.split(",") if n]
        if i == runs - 1 and (args.extra or required):
            summarize_extra(summary, args.extra, args.extra_exit, required)
        allowed = read_expected_skips(args.expected_skips, summary) if args.expected_skips else []
        check_skips(summary, allowed, args.enforce_skips)
        if summary.passed == 0 and summary.failed == 0:
            summary.fail("no test ran")
        summaries.append(summary)

    for i, summary in enumerate(summaries):
        if names:
            print("== %s%s" % (names[i], "" if runs == 1 else ": " + counts_line(summary)))
        print_summary(summary)
        total.passed += summary.passed
        total.skipped += summary.skipped
        total.failed += summary.failed
        total.excluded += summary.excluded
    print(counts_line(total))
    return 1 if total.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
