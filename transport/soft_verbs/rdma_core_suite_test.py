"""rdma-core's own test suite (the pyverbs tests Debian ships in the rdma-core package's
documentation folder), run unmodified on soft0 through libswirl_soft_verbs.so.

Every one of its tests is listed in rdma_core_expected.txt beside this file, as "TEST pass" or
"TEST skip REASON" (REASON is the test's own skip message; "re:" before it makes it a regular
expression, for messages that name something of the machine). A test that fails or errors,
passes where a skip is expected, skips where a pass is expected or with another reason, or is
not listed at all, fails here; so does a listed test the suite no longer has. Each rdma-core
test is one case in this target's test.xml: passed, skipped with its reason (prefixed
"expected: ", which tools/expected_skips.txt allows for this target), or failed.

The suite is the version matching Debian's python3-pyverbs (both come from rdma-core 44); it is
copied out of /usr/share/doc/rdma-core/tests and gunzipped, as its README says to, and loaded
with the same loader as its run_tests.py, with --dev soft0. LD_PRELOAD is set by the BUILD
rule: libibverbs is loaded by pyverbs at import, in this process.

SWIRL_RDMA_CORE_TESTS_WRITE_EXPECTED=FILE writes what this run saw to FILE in the expected
file's format (to review and commit after a change to the soft device).
"""

import gzip
import os
import re
import shutil
import sys
import tempfile
import time
import unittest
import xml.etree.ElementTree as ET

SOURCE = "/usr/share/doc/rdma-core/tests"
HERE = os.path.dirname(os.path.abspath(__file__))
EXPECTED = os.path.join(HERE, "rdma_core_expected.txt")
DEVICE = "soft0"


def unpack(dest):
    """The suite as runnable files in dest/tests."""
    tests = os.path.join(dest, "tests")
    shutil.copytree(SOURCE, tests)
    for name in os.listdir(tests):
        if name.endswith(".gz"):
            path = os.path.join(tests, name)
            with gzip.open(path, "rb") as src, open(path[:-3], "wb") as out:
                shutil.copyfileobj(src, out)
            os.remove(path)
    return tests


def load_suite(tests_dir):
    """The suite's tests, loaded as its run_tests.py does, configured for soft0."""
    sys.path.insert(0, tests_dir)
    from importlib.machinery import SourceFileLoader
    from args_parser import parser  # the suite's own

    saved = sys.argv
    sys.argv = [os.path.join(tests_dir, "run_tests.py"), "--dev", DEVICE]
    parser.parse_args()
    sys.argv = saved
    module = SourceFileLoader("tests", os.path.join(tests_dir, "__init__.py")).load_module()
    return unittest.defaultTestLoader.loadTestsFromModule(module)


class Recorder(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.outcomes = {}  # test id -> (outcome, detail, seconds)
        self._start = 0.0

    def startTest(self, test):
        self._start = time.monotonic()
        super().startTest(test)

    def _set(self, test, outcome, detail=""):
        self.outcomes[test.id()] = (outcome, detail, time.monotonic() - self._start)

    def addSuccess(self, test):
        self._set(test, "pass")

    def addSkip(self, test, reason):
        self._set(test, "skip", reason)

    def addFailure(self, test, err):
        self._set(test, "fail", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        # setUpClass errors arrive with a _ErrorHolder, not a test case: name them as unittest
        # does, so they are reported rather than lost.
        self.outcomes[getattr(test, "id", lambda: str(test))()] = (
            "error", self._exc_info_to_string(err, test), 0.0)

    def addExpectedFailure(self, test, err):
        self._set(test, "fail", "expected failures are not allowed here")

    def addUnexpectedSuccess(self, test):
        self._set(test, "fail", "unexpected success")


def read_expected(path):
    expected = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.split(" ", 2)
            if len(parts) == 2 and parts[1] == "pass":
                expected[parts[0]] = ("pass", None)
            elif len(parts) == 3 and parts[1] == "skip":
                reason = parts[2]
                pattern = (re.compile(reason[3:]) if reason.startswith("re:") else
                           re.compile(re.escape(reason) + r"\Z"))
                expected[parts[0]] = ("skip", pattern)
            else:
                raise ValueError("%s:%d: not 'TEST pass' or 'TEST skip REASON': %r" %
                                 (path, n, line))
    return expected


def judge(outcomes, expected):
    """[(test id, verdict, detail, seconds)]: verdict is passed, skipped or failed."""
    verdicts = []
    for test_id in sorted(set(outcomes) | set(expected)):
        outcome, detail, seconds = outcomes.get(test_id, ("missing", "", 0.0))
        want, pattern = expected.get(test_id, (None, None))
        if outcome == "missing":
            verdicts.append((test_id, "failed", "listed in rdma_core_expected.txt as %s but "
                             "the suite has no such test" % want, seconds))
        elif want is None:
            verdicts.append((test_id, "failed", "not listed in rdma_core_expected.txt (it %s%s)"
                             % ("passed" if outcome == "pass" else outcome + "ed",
                                ": " + detail if detail else ""), seconds))
        elif outcome in ("fail", "error"):
            verdicts.append((test_id, "failed", detail, seconds))
        elif outcome == "pass" and want == "pass":
            verdicts.append((test_id, "passed", "", seconds))
        elif outcome == "skip" and want == "skip" and pattern.match(detail):
            verdicts.append((test_id, "skipped", "expected: " + detail, seconds))
        elif outcome == "pass":
            verdicts.append((test_id, "failed", "passed, but rdma_core_expected.txt expects a "
                             "skip: update it", seconds))
        else:
            verdicts.append((test_id, "failed", "skipped (%s), but rdma_core_expected.txt "
                             "expects %s" % (detail, "a pass" if want == "pass" else
                                            "another reason: " + pattern.pattern), seconds))
    return verdicts


def write_xml(path, verdicts):
    root = ET.Element("testsuites")
    suite = ET.SubElement(root, "testsuite", name="rdma_core")
    for test_id, verdict, detail, seconds in verdicts:
        classname, _, name = test_id.rpartition(".")
        case = ET.SubElement(suite, "testcase", classname=classname, name=name,
                             time="%.3f" % seconds, status="run",
                             result="skipped" if verdict == "skipped" else "completed")
        if verdict == "failed":
            ET.SubElement(case, "failure", message=detail.strip().splitlines()[-1][:500]
                          if detail.strip() else "failed").text = detail
        elif verdict == "skipped":
            ET.SubElement(case, "skipped", message=detail)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def write_expected(path, outcomes):
    with open(path, "w") as f:
        for test_id in sorted(outcomes):
            outcome, detail, _ = outcomes[test_id]
            if outcome == "pass":
                f.write("%s pass\n" % test_id)
            elif outcome == "skip":
                f.write("%s skip %s\n" % (test_id, detail.replace("\n", " ")))
            else:
                f.write("%s %s\n" % (test_id, outcome))


def main():
    if not os.path.isdir(SOURCE):
        print("rdma-core's tests are not at %s: install the rdma-core package" % SOURCE)
        return 1
    # Absolute, so the processes some tests start find it from any directory.
    preload = os.environ.get("LD_PRELOAD", "")
    if preload:
        os.environ["LD_PRELOAD"] = os.path.abspath(preload)
    # Under --config=tsan the library brings TSan into this interpreter, which is not built with
    # it: TSan's runtime must be loaded first (before libc, so that its interceptors are the
    # ones called), so the interpreter starts again that way before it opens any device.
    if "TSAN_OPTIONS" in os.environ and preload and not preload.startswith("libtsan"):
        os.environ["LD_PRELOAD"] = "libtsan.so.2:" + os.environ["LD_PRELOAD"]
        os.execv(sys.executable, [sys.executable] + sys.argv)
    work = tempfile.mkdtemp(prefix="rdma-core-tests-", dir=os.environ.get("TEST_TMPDIR"))
    tests_dir = unpack(work)
    os.chdir(work)
    suite = load_suite(tests_dir)
    result = Recorder()
    suite.run(result)
    if os.environ.get("SWIRL_RDMA_CORE_TESTS_WRITE_EXPECTED"):
        write_expected(os.environ["SWIRL_RDMA_CORE_TESTS_WRITE_EXPECTED"], result.outcomes)
    verdicts = judge(result.outcomes, read_expected(EXPECTED))
    counts = {}
    for test_id, verdict, detail, _ in verdicts:
        counts[verdict] = counts.get(verdict, 0) + 1
        if verdict == "failed":
            print("FAILED %s: %s" % (test_id, detail))
    print("rdma-core's suite on %s: %d passed, %d skipped as expected, %d failed" %
          (DEVICE, counts.get("passed", 0), counts.get("skipped", 0), counts.get("failed", 0)))
    if os.environ.get("XML_OUTPUT_FILE"):
        write_xml(os.environ["XML_OUTPUT_FILE"], verdicts)
    return 0 if counts.get("failed", 0) == 0 and counts.get("passed", 0) > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
