"""Runs a Python unittest suite under Bazel and writes its cases to $XML_OUTPUT_FILE.

Bazel counts a test that writes no XML as one case; `./swirl test` counts cases, so Python
tests call main() from here to have each of their cases counted (and their skips listed with
their reasons), as gtest binaries do.
"""

import os
import sys
import time
import unittest
import xml.etree.ElementTree as ET


class _Recorder(unittest.TextTestResult):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records = []  # (test, outcome, detail, seconds)
        self._started = 0.0

    def startTest(self, test):
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test, outcome, detail=""):
        self.records.append((test, outcome, detail, time.monotonic() - self._started))

    def addSuccess(self, test):
        super().addSuccess(test)
        self._record(test, "passed")

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._record(test, "failure", self._exc_info_to_string(err, test))

    def addError(self, test, err):
        super().addError(test, err)
        self._record(test, "error", self._exc_info_to_string(err, test))

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self._record(test, "skipped", reason)

    def addExpectedFailure(self, test, err):
        super().addExpectedFailure(test, err)
        self._record(test, "failure", "expected failures are not allowed here")

    def addUnexpectedSuccess(self, test):
        super().addUnexpectedSuccess(test)
        self._record(test, "failure", "unexpected success")


def write_xml(path, records):
    root = ET.Element("testsuites")
    suites = {}
    for test, outcome, detail, seconds in records:
        classname = type(test).__name__
        suite = suites.get(classname)
        if suite is None:
            suite = suites[classname] = ET.SubElement(root, "testsuite", name=classname)
        case = ET.SubElement(suite, "testcase", classname=classname,
                             name=test._testMethodName, time="%.3f" % seconds,
                             status="run", result="skipped" if outcome == "skipped" else
                             "completed")
        if outcome in ("failure", "error"):
            ET.SubElement(case, outcome, message=detail.splitlines()[-1] if detail else
                          outcome).text = detail
        elif outcome == "skipped":
            ET.SubElement(case, "skipped", message=detail)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def main(module="__main__"):
    suite = unittest.defaultTestLoader.loadTestsFromModule(sys.modules[module])
    runner = unittest.TextTestRunner(resultclass=_Recorder, verbosity=2, stream=sys.stdout)
    result = runner.run(suite)
    if os.environ.get("XML_OUTPUT_FILE"):
        write_xml(os.environ["XML_OUTPUT_FILE"], result.records)
    sys.exit(0 if result.wasSuccessful() and result.testsRun > 0 else 1)
