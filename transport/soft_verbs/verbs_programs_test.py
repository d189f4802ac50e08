"""Verbs programs no one here wrote, run unmodified on soft0 through libswirl_soft_verbs.so.

ibverbs-utils (ibv_devices, ibv_devinfo -v, ibv_rc_pingpong with and without completion
events, message sizes 1 B to 64 KiB) and perftest (ib_send_lat, ib_write_lat, ib_read_lat,
ib_send_bw, ib_write_bw, ib_read_bw): each a server and a client process on this host over the
program's own TCP exchange, short runs, each side checked for its exit status and for the
program's result line. These are checks that the programs work, never of their speed
(bench/ measures that).
"""

import os
import re
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tools import junit  # noqa: E402

LIB = os.path.abspath(os.environ["SWIRL_SOFT_VERBS_LIB"])
DEVICE = "soft0"
TIMEOUT = 120  # seconds a program may take before it counts as hung


def soft_env():
    env = dict(os.environ, LD_PRELOAD=LIB)
    env.pop("SWIRL_SOFT_TCP", None)
    # Under --config=asan the library brings ASan into these programs: their own leaks (and the
    # soft device they leave open, which lives on by design) are not ours to judge here;
    # interposer_test checks ours.
    if "ASAN_OPTIONS" in env:
        env["ASAN_OPTIONS"] += ":detect_leaks=0"
    # Under --config=tsan the library brings TSan into programs not built with it, whose
    # libc would otherwise come before TSan's interceptors (malloc, pthread_create): its
    # runtime must be loaded first.
    if "TSAN_OPTIONS" in env:
        env["LD_PRELOAD"] = "libtsan.so.2:" + env["LD_PRELOAD"]
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv):
    p = subprocess.run(argv, env=soft_env(), capture_output=True, text=True, timeout=TIMEOUT)
    return p.returncode, p.stdout + p.stderr


def pair(server_argv, client_argv):
    """Runs a server and then a client against it; returns (server, client) as (rc, output).

    The servers take one connection, so nothing may probe their port: the client is retried
    until it gets past connecting (both programs say "Couldn't connect" until the server
    listens), or the server gives up."""
    server = subprocess.Popen(server_argv, env=soft_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        client = (1, "the server exited before the client could connect")
        while time.monotonic() < deadline and server.poll() is None:
            client = run(client_argv)
            if "Couldn't connect" not in client[1]:
                break
            time.sleep(0.05)
        out, _ = server.communicate(timeout=TIMEOUT)
        return (server.returncode, out), client
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


class IbverbsUtilsTest(unittest.TestCase):
    def test_ibv_devices_lists_soft0(self):
        rc, out = run(["ibv_devices"])
        self.assertEqual(rc, 0, out)
        self.assertRegex(out, r"\n\s*soft0\s+[0-9a-f]{16}\n")

    def test_ibv_devinfo_verbose_reports_soft0_fully(self):
        rc, out = run(["ibv_devinfo", "-v", "-d", DEVICE])
        self.assertEqual(rc, 0, out)
        for field in (r"hca_id:\s+soft0", r"vendor_id:\s+0x5a5357", r"node_guid:\s+[0-9a-f:]{19}",
                      r"max_qp:\s+[1-9]", r"max_mw:\s+[1-9]", r"MEM_WINDOW_TYPE_2B",
                      r"MEM_MGT_EXTENSIONS", r"atomic_cap:\s+ATOMIC_HCA",
                      r"state:\s+PORT_ACTIVE", r"link_layer:\s+Ethernet",
                      r"GID\[\s*0\]:\s+\S+, RoCE v2"):
            self.assertRegex(out, field)

    def pingpong(self, *args):
        port = free_port()
        base = ["ibv_rc_pingpong", "-d", DEVICE, "-g", "0", "-p", str(port), "-n", "200"]
        base += list(args)
        (src, sout), (crc, cout) = pair(base, base + ["127.0.0.1"])
        self.assertEqual(src, 0, sout)
        self.assertEqual(crc, 0, cout)
        for out in (sout, cout):
            self.assertRegex(out, r"\d+ bytes in [\d.]+ seconds = [\d.]+ Mbit/sec")
            self.assertRegex(out, r"200 iters in [\d.]+ seconds = [\d.]+ usec/iter")

    def test_ibv_rc_pingpong(self):
        self.pingpong()

    def test_ibv_rc_pingpong_with_completion_events(self):
        self.pingpong("-e")

    def test_ibv_rc_pingpong_sizes_from_1_byte_to_64_kib(self):
        for size in (1, 2, 63, 64, 65, 4096, 4097, 65536):
            with self.subTest(size=size):
                self.pingpong("-s", str(size))


# Each perftest program, with the result line it prints: bytes, iterations, then numbers.
PERFTEST = {
    "ib_send_lat": r"^\s*2\s+100\s+[\d.]+\s+[\d.]+\s+[\d.]+",
    "ib_write_lat": r"^\s*2\s+100\s+[\d.]+\s+[\d.]+\s+[\d.]+",
    "ib_read_lat": r"^\s*2\s+100\s+[\d.]+\s+[\d.]+\s+[\d.]+",
    "ib_send_bw": r"^\s*65536\s+200\s+[\d.]+\s+[\d.]+\s+[\d.]+",
    "ib_write_bw": r"^\s*65536\s+200\s+[\d.]+\s+[\d.]+\s+[\d.]+",
    "ib_read_bw": r"^\s*65536\s+200\s+[\d.]+\s+[\d.]+\s+[\d.]+",
}


class PerftestTest(unittest.TestCase):
    def perftest(self, program, *extra):
        port = free_port()
        iters = "100" if program.endswith("_lat") else "200"
        base = [program, "-d", DEVICE, "-x", "0", "-n", iters, "-p", str(port)] + list(extra)
        (src, sout), (crc, cout) = pair(base, base + ["127.0.0.1"])
        self.assertEqual(src, 0, sout)
        self.assertEqual(crc, 0, cout)
        # Latency results print on the client; bandwidth results on both sides.
        self.assertRegex(cout, re.compile(PERFTEST[program], re.M))
        if program.endswith("_bw"):
            self.assertRegex(sout, re.compile(PERFTEST[program], re.M))


def add_perftest_cases():
    for program in PERFTEST:
        setattr(PerftestTest, "test_" + program,
                lambda self, p=program: self.perftest(p))


add_perftest_cases()

if __name__ == "__main__":
    junit.main()
