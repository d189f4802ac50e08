"""`./swirl bench` in miniature: bench/swirl_bench.py with one round of 20 ms per row, over the
fastbuild tools in this test's runfiles. Checks that the Markdown table and the JSON beside it
have every row the issue asks for, with numbers in order (p50 <= p99 <= ... <= max) and the
ratios to the reference rows, the machine and the commands; that a peer is "not installed"
(with its package) exactly when its tool is absent; and that bench/swirl_bench.py merges
histograms with base/histogram.h's buckets. Nothing here judges speed. Loopback only.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
RUNFILES_ROOT = os.path.dirname(HERE)  # the workspace's root inside the runfiles
sys.path.insert(0, RUNFILES_ROOT)
sys.path.insert(0, HERE)
from tools import junit  # noqa: E402
import swirl_bench  # noqa: E402

# Every row of the table, by id (a row missing from bench/swirl_bench.py fails here).
EXPECTED_ROWS = [
    "floor", "verbs_send", "verbs_write", "verbs_read",
    "perftest_send", "perftest_write", "perftest_read",
    "rpc_raw", "rpc_proto",
    "bulk_4k_remote", "bulk_4k_local", "bulk_64k_remote", "bulk_64k_local",
    "bulk_1m_remote", "bulk_1m_local",
    "grpc",
    "ucx_am_shm", "ucx_tag_shm", "ucx_am_tcp", "ucx_tag_tcp",
    "fi_shm", "fi_tcp",
    "mw_static_mr", "mw_bind_inv", "mw_bind_local_inv", "mw_reg_mr",
]
# The peers' tools and packages: only these rows may say "not installed", and only when the
# tool is really absent.
PEER_TOOLS = {
    "perftest_send": ("ib_send_lat", "perftest"), "perftest_write": ("ib_write_lat", "perftest"),
    "perftest_read": ("ib_read_lat", "perftest"),
    "ucx_am_shm": ("ucx_perftest", "ucx-utils"), "ucx_tag_shm": ("ucx_perftest", "ucx-utils"),
    "ucx_am_tcp": ("ucx_perftest", "ucx-utils"), "ucx_tag_tcp": ("ucx_perftest", "ucx-utils"),
    "fi_shm": ("fi_pingpong", "libfabric-bin"), "fi_tcp": ("fi_pingpong", "libfabric-bin"),
}
TIMEOUT = 600


def bench_env(path=None):
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    # Under --config=asan the preloaded interposer brings ASan into perftest: its own leaks
    # are not ours to judge here (interposer_test judges ours).
    if "ASAN_OPTIONS" in env:
        env["ASAN_OPTIONS"] += ":detect_leaks=0"
    return env


def run_bench(out_dir, extra=(), path=None):
    argv = [sys.executable, os.path.join(HERE, "swirl_bench.py"), "--quick", "--rounds", "1",
            "--seconds", "0.02", "--bin", RUNFILES_ROOT, "--out", out_dir, "--quiet"] + list(extra)
    p = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT,
                       env=bench_env(path), cwd=RUNFILES_ROOT)
    with open(os.path.join(out_dir, "latest.json")) as f:
        report = json.load(f)
    with open(os.path.join(out_dir, "latest.md")) as f:
        md = f.read()
    return p, report, md


class HistogramTest(unittest.TestCase):
    def test_buckets_match_base_histogram(self):
        # base/histogram.h: exact below 256, then 128 buckets per power of two.
        for v, lower in ((0, 0), (255, 255), (256, 256), (257, 256), (511, 510), (512, 512),
                         (1003, 1000), (1000, 1000), (123456, 123392)):
            self.assertEqual(swirl_bench.bucket_lower(v), lower, v)
        self.assertEqual(swirl_bench.bucket_width(1000), 4)
        self.assertEqual(swirl_bench.bucket_width(200), 1)

    def test_percentiles_and_merge(self):
        a, b = swirl_bench.Hist(), swirl_bench.Hist()
        for v in (3, 5, 7, 255):
            a.add(v)
        b.add_buckets([[1000, 3]], 1001, 1002, 1001.5)
        self.assertEqual(a.percentile(0.5), 5)
        self.assertEqual(a.percentile(1.0), 255)
        a.merge(b)
        self.assertEqual(a.n, 7)
        self.assertEqual(a.max, 1002)
        self.assertEqual(a.percentile(0.6), 1001)  # bucket [1000, 1004)'s midpoint
        self.assertEqual(a.cdf()[-1], (1002, 1.0))


class SwirlBenchSmokeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.out = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        cls.proc, cls.report, cls.md = run_bench(cls.out)

    def test_exits_zero(self):
        self.assertEqual(self.proc.returncode, 0, self.proc.stdout[-2000:] + self.proc.stderr[-2000:])

    def test_every_row_in_json_and_table(self):
        rows = {r["id"]: r for r in self.report["rows"]}
        self.assertEqual(sorted(rows), sorted(EXPECTED_ROWS))
        for rid in EXPECTED_ROWS:
            r = rows[rid]
            self.assertIn(r["label"], self.md, rid)
            tool, package = PEER_TOOLS.get(rid, (None, None))
            if tool is not None and shutil.which(tool) is None:
                self.assertEqual(r["status"], "not installed", rid)
                self.assertEqual(r["package"], package, rid)
                continue
            self.assertEqual(r["status"], "ok", f"{rid}: {r.get('errors')}")
            self.assertEqual(r["rounds_ok"], 1, rid)
            self.assertIsNotNone(r.get("p50_us"), rid)
            self.assertGreater(r["p50_us"], 0, rid)
            self.assertIsNotNone(r.get("ops_per_s"), rid)
            self.assertGreater(r["ops_per_s"], 0, rid)
            self.assertTrue(r["commands"], rid)
            for c in r["commands"]:
                self.assertIn(f"`{c}`", self.md, rid)
            if "p99_us" in r:  # a tool that reports the distribution
                order = [r[k] for k in ("p50_us", "p99_us", "p999_us", "p9999_us", "max_us")]
                self.assertEqual(order, sorted(order), rid)
            self.assertIsNotNone(r["ratio_floor"], rid)
            self.assertIsNotNone(r["ratio_verbs"], rid)
        self.assertAlmostEqual(rows["floor"]["ratio_floor"], 1.0)
        self.assertAlmostEqual(rows["verbs_send"]["ratio_verbs"], 1.0)
        for rid in ("bulk_4k_remote", "bulk_1m_local"):
            self.assertGreater(rows[rid]["gbytes_per_s"], 0, rid)
        for rid in ("mw_bind_inv", "mw_bind_local_inv", "mw_reg_mr"):
            self.assertGreater(rows[rid]["window_ns"], 0, rid)
            self.assertGreater(rows[rid]["windows_per_s_per_core"], 0, rid)
            self.assertIn("added_p50_us", rows[rid])

    def test_machine_and_commands(self):
        m = self.report["machine"]
        self.assertEqual(m["cores"], os.cpu_count())
        self.assertTrue(m["cpu"])
        self.assertIn(m["cpu"], self.md)
        self.assertIn(f"kernel {m['kernel']}", self.md)
        self.assertIn("| row | p50 | p99 | p99.9 | p99.99 | max | throughput | / floor | / verbs RTT |",
                      self.md)


class NotInstalledTest(unittest.TestCase):
    def test_absent_peer_tools_give_not_installed_rows(self):
        # A PATH with everything the script runs except the UCX and libfabric tools.
        bin_dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        for tool in ("taskset", "git", "systemd-detect-virt"):
            where = shutil.which(tool)
            if where:
                os.symlink(where, os.path.join(bin_dir, tool))
        out = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        proc, report, md = run_bench(out, ["--only", "ucx,libfabric"], path=bin_dir)
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        rows = {r["id"]: r for r in report["rows"]}
        # The reference rows always run; the peers say what to install.
        self.assertEqual(sorted(rows), sorted(["floor", "verbs_send", "ucx_am_shm", "ucx_tag_shm",
                                               "ucx_am_tcp", "ucx_tag_tcp", "fi_shm", "fi_tcp"]))
        self.assertEqual(rows["floor"]["status"], "ok")
        for rid in ("ucx_am_shm", "ucx_tag_tcp", "fi_shm", "fi_tcp"):
            self.assertEqual(rows[rid]["status"], "not installed", rid)
            package = PEER_TOOLS[rid][1]
            self.assertIn(f"| {rows[rid]['label']} | not installed (`apt-get install {package}`", md)


if __name__ == "__main__":
    junit.main()
