#!/usr/bin/env python3
"""Counts test cases from Bazel's test.xml files and prints swirl's summary line.

Usage: test_summary.py BAZEL_OUTPUT_FILE TESTLOGS_DIR [--extra RESULTS_FILE]

Every gtest case counts once. A test target that failed without a usable XML (it crashed, timed
out, failed to build, or a sanitizer failed it after its cases passed) counts as one failure of
its own, so a red target can never hide behind green cases. Skipped cases are listed with the
reason their test gave. The last line printed is "N passed, N failed[, N skipped]".

RESULTS_FILE holds results of checks that run outside Bazel (tools/embedding_check.sh), one per
line: "PASSED name" or "FAILED name"; each counts once, like a test case. A missing or empty file
adds nothing.
"""

import os
import re
import sys
import xml.etree.ElementTree as ET

STATUS_RE = re.compile(
    r"^(//\S+)\s+(?:\(cached\)\s+)?(PASSED|FAILED|TIMEOUT|FLAKY|NO STATUS|FAILED TO BUILD|"
    r"SKIPPED|INCOMPLETE)\b")


def target_dir(testlogs, label):
    pkg, name = label[2:].split(":", 1)
    return os.path.join(testlogs, pkg, name)


def read_extra(path):
    """[(name, passed)] from a RESULTS_FILE; a malformed line counts as a failure of its own."""
    results = []
    if not path or not os.path.exists(path):
        return results
    with open(path, errors="replace") as f:
        for line in f:
            parts = line.split(None, 1)
            if not parts:
                continue
            if len(parts) == 2 and parts[0] in ("PASSED", "FAILED"):
                results.append((parts[1].strip(), parts[0] == "PASSED"))
            else:
                results.append(("%s (malformed result line: %r)" % (path, line.strip()), False))
    return results


def main():
    args = sys.argv[1:]
    extra_file = None
    if "--extra" in args:
        i = args.index("--extra")
        if i + 1 >= len(args):
            sys.exit("test_summary.py: --extra needs a file")
        extra_file = args[i + 1]
        del args[i:i + 2]
    output_file, testlogs = args[0], args[1]
    statuses = {}
    with open(output_file, errors="replace") as f:
        for line in f:
            m = STATUS_RE.match(line.strip())
            if m:
                statuses[m.group(1)] = m.group(2)
    passed = failed = skipped = 0
    failures, skips = [], []
    for label, status in sorted(statuses.items()):
        xml_path = os.path.join(target_dir(testlogs, label), "test.xml")
        cases_failed = 0
        counted = False
        if status in ("PASSED", "FAILED", "FLAKY") and os.path.exists(xml_path):
            try:
                root = ET.parse(xml_path).getroot()
            except ET.ParseError:
                root = None
            if root is not None:
                for case in root.iter("testcase"):
                    counted = True
                    name = "%s %s.%s" % (label, case.get("classname"), case.get("name"))
                    if case.find("failure") is not None or case.find("error") is not None:
                        failed += 1
                        cases_failed += 1
                        failures.append(name)
                    elif case.get("result") == "skipped" or case.find("skipped") is not None:
                        skipped += 1
                        node = case.find("skipped")
                        reason = (node.get("message") or "").strip() if node is not None else ""
                        reason = reason.splitlines()[-1] if reason else "(no reason given)"
                        skips.append("%s: %s" % (name, reason))
                    else:
                        passed += 1
        if status in ("PASSED", "FLAKY") and not counted:
            passed += 1  # a test target that is not gtest (a shell test)
        elif status not in ("PASSED", "FLAKY") and cases_failed == 0:
            failed += 1
            failures.append("%s (%s)" % (label, status.lower()))
    for name, ok in read_extra(extra_file):
        if ok:
            passed += 1
        else:
            failed += 1
            failures.append(name)
    for s in skips:
        print("skipped: " + s)
    for f in failures:
        print("FAILED: " + f)
    line = "%d passed, %d failed" % (passed, failed)
    if skipped:
        line += ", %d skipped" % skipped
    print(line)
    return 1 if failed or not statuses else 0


if __name__ == "__main__":
    sys.exit(main())
