#!/usr/bin/env python3
"""Checks that the tests the docs name exist.

docs/SECURITY.md and docs/RELIABILITY.md back every claim with a test ("`rpc:e2e_test
E2ETest.AuthenticationFailuresAreRefusedBeforeAnyQueuePair`"); a renamed or deleted test would
leave a claim that nothing checks. Every backticked name of these forms must exist:

  `pkg:target`        a target of pkg/BUILD (a variant such as NAME_tcp or NAME_rdma_core
                      counts when NAME is there: tools/test_variants.bzl makes them)
  `Suite.Case`        a TEST, TEST_F or TEST_P(Suite, Case) in a .cc file of the tree
  `Suite.*`           some test of that suite
  `.Case`             a case of the last Suite named before it in the same paragraph

Usage: doc_tests_check.py ROOT DOC...   (exit 1, listing each missing name, if any is missing)
"""

import os
import re
import sys

TEST_RE = re.compile(r"\bTEST(?:_F|_P)?\(\s*(\w+)\s*,\s*(\w+)\s*\)")
# Tests registered at run time (rpc/netns_test.cc): RegisterTest("Suite", ...) through a helper
# called as add("Case", ...).
REGISTERED_SUITE = re.compile(r'RegisterTest\(\s*"(\w+)"')
REGISTERED_CASE = re.compile(r'\badd\(\s*"(\w+)"')
TICKED = re.compile(r"`([^`\n]+)`")
TARGET = re.compile(r"^(?://)?([a-z0-9_/]+):([A-Za-z0-9_]+)$")
SUITE_CASE = re.compile(r"^([A-Z]\w*)\.([A-Z]\w*|\*)$")
CASE = re.compile(r"^\.([A-Z]\w*)$")
VARIANT_SUFFIXES = ("_tcp", "_rdma_core", "_shm")


def collect_tests(root):
    tests = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(("bazel-", "."))]
        for name in filenames:
            if not name.endswith(".cc"):
                continue
            with open(os.path.join(dirpath, name), encoding="utf-8", errors="replace") as f:
                text = f.read()
            for suite, case in TEST_RE.findall(text):
                tests.add((suite, case))
            for suite in REGISTERED_SUITE.findall(text):
                for case in REGISTERED_CASE.findall(text):
                    tests.add((suite, case))
    return tests


def target_exists(root, package, target):
    build = os.path.join(root, package, "BUILD")
    if not os.path.exists(build):
        return False
    with open(build, encoding="utf-8") as f:
        text = f.read()
    names = [target] + [target[: -len(s)] for s in VARIANT_SUFFIXES if target.endswith(s)]
    # A variant is declared by its base's name and the suffix, or as ("NAME", ...) tuples.
    return any(re.search(r'"%s"' % re.escape(n), text) for n in names)


def check(root, doc, tests):
    suites = {s for s, _ in tests}
    missing = []
    with open(doc, encoding="utf-8") as f:
        paragraphs = re.split(r"\n\s*\n", f.read())
    for paragraph in paragraphs:
        # A table row is a paragraph of its own: `.Case` refers to its row's suite.
        for block in paragraph.split("\n| ") if paragraph.lstrip().startswith("|") else [paragraph]:
            last_suite = None
            for token in TICKED.findall(block):
                for part in token.split():
                    part = part.strip(",;()")
                    m = TARGET.match(part)
                    if m:
                        if not target_exists(root, m.group(1), m.group(2)):
                            missing.append("target %s" % part)
                        continue
                    m = SUITE_CASE.match(part)
                    if m:
                        last_suite = m.group(1)
                        if m.group(2) == "*":
                            ok = m.group(1) in suites
                        else:
                            ok = (m.group(1), m.group(2)) in tests
                        if not ok:
                            missing.append("test %s" % part)
                        continue
                    m = CASE.match(part)
                    if m and last_suite is not None:
                        if (last_suite, m.group(1)) not in tests:
                            missing.append("test %s%s" % (last_suite, part))
    return missing


def main(argv):
    if len(argv) < 3:
        print(__doc__)
        return 2
    root = argv[1]
    tests = collect_tests(root)
    failed = False
    for doc in argv[2:]:
        missing = check(root, doc, tests)
        for m in missing:
            print("%s: names a %s that does not exist" % (doc, m))
        failed |= bool(missing)
        print("%s: %s" % (doc, "every named test exists" if not missing else
                          "%d names missing" % len(missing)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
