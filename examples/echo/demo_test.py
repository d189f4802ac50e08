"""`./swirl demo` as a test: the demo binary runs to its end and says each of its parts succeeded.

The demo checks every step itself (exit status 1 if one does not happen); this test asserts the
exit status and that each part printed its success line, so a part that silently stopped being
shown fails here too. Fewer calls than the default: the test is about the parts, not the
latency numbers.
"""

import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools import junit  # noqa: E402

DEMO = os.path.abspath(os.environ["SWIRL_DEMO"])
TIMEOUT = 240  # seconds before the demo counts as hung (it takes well under 30 when alone)


class DemoTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        p = subprocess.run([DEMO, "--calls=2000", "--grpc_calls=1000"], capture_output=True,
                           text=True, timeout=TIMEOUT)
        cls.rc = p.returncode
        cls.out = p.stdout
        cls.err = p.stderr

    def check(self, *lines):
        for line in lines:
            self.assertIn(line, self.out, f"stdout:\n{self.out}\nstderr:\n{self.err}")

    def test_exits_zero_and_says_so(self):
        self.assertEqual(self.rc, 0, f"stdout:\n{self.out}\nstderr:\n{self.err}")
        self.assertEqual(self.out.strip().splitlines()[-1],
                         "== demo succeeded: small calls, 1 MiB up and down through per-request "
                         "windows, revoked rkey refused by the device, wrong token refused, "
                         "clean shutdown ==")

    def test_small_calls_beside_grpc(self):
        self.check("ok [1] small calls: swirl p50 ", "   swirl    ", "   gRPC     ")

    def test_bulk_through_windows_revoked_by_send_with_inv(self):
        self.check("invalidation mode INVALIDATION_REMOTE",
                   "windows_remote_invalidated +1, windows_locally_invalidated +0",
                   "ok [2] bulk: 1 MiB each way, checksums match, each window revoked by "
                   "SEND_WITH_INV (mode INVALIDATION_REMOTE)")

    def test_hostile_read_refused(self):
        self.check("hostile_client: READ again with the revoked rkey: remote access error "
                   "(IBV_WC_REM_ACCESS_ERR)",
                   "ok [3] hostile client: READ with a revoked rkey refused")
        self.assertNotIn("ATTACK SUCCEEDED", self.out)

    def test_wrong_token_refused(self):
        self.check("ok [4] wrong token refused")

    def test_clean_shutdown(self):
        self.check("echo_server: served ", "ok [5] clean shutdown: server exit 0")


if __name__ == "__main__":
    junit.main()
