#!/usr/bin/env python3
"""tools/doc_tests_check.py: the docs whose claims name tests name only tests that exist, and the
checker itself finds a missing target, suite, case or follow-on `.Case`."""

import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECK = os.path.join(HERE, "doc_tests_check.py")
# The source tree itself, not the runfiles: the check must see every package's tests and docs,
# which no one target's data can hold. Runfiles link to the sources, so the link's target is in
# the workspace (tools/BUILD runs this test locally and never caches it, for the same reason).
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def run(root, *docs):
    return subprocess.run([sys.executable, CHECK, root, *docs], capture_output=True, text=True)


class DocTestsCheck(unittest.TestCase):
    def test_security_and_reliability_name_only_tests_that_exist(self):
        r = run(ROOT, os.path.join(ROOT, "docs/SECURITY.md"),
                os.path.join(ROOT, "docs/RELIABILITY.md"))
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_a_missing_name_of_each_form_is_found(self):
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "pkg"))
            with open(os.path.join(root, "pkg", "BUILD"), "w") as f:
                f.write('cc_test(name = "thing_test")\n')
            with open(os.path.join(root, "pkg", "thing_test.cc"), "w") as f:
                f.write("TEST(Thing, Works) {}\nTEST_F(Thing, AlsoWorks) {}\n")
            doc = os.path.join(root, "doc.md")
            with open(doc, "w") as f:
                f.write("| claim | `pkg:thing_test Thing.Works`, `.AlsoWorks`, `Thing.*` |\n\n")
            self.assertEqual(run(root, doc).returncode, 0, run(root, doc).stdout)
            for bad, named in [("`pkg:other_test`", "target pkg:other_test"),
                               ("`Thing.Breaks`", "test Thing.Breaks"),
                               ("`Thing.Works`, `.Breaks`", "test Thing.Breaks"),
                               ("`Other.*`", "test Other.*")]:
                with open(doc, "w") as f:
                    f.write("| claim | %s |\n" % bad)
                r = run(root, doc)
                self.assertEqual(r.returncode, 1, bad)
                self.assertIn(named, r.stdout)


if __name__ == "__main__":
    unittest.main()
