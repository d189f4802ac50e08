#!/usr/bin/env python3
"""perftest on soft0 (through libswirl_soft_verbs.so) beside swirl's own verbs_perf.

  bazel build -c opt //bench:verbs_perf //transport/soft_verbs:libswirl_soft_verbs.so
  python3 bench/perftest_compare.py [--rounds 9] [--quick]

Rows: 64 B SEND/RECV round trip (ib_send_lat's t_typical, which is half a round trip, doubled,
against verbs_perf --test send_lat's p50) and RDMA WRITE bandwidth at 64 B and 1 MiB
(ib_write_bw against verbs_perf --test write_bw, both MiB/s). Each round runs every command
once, in an order that rotates from round to round (this 2-vCPU VM changes speed within
seconds); the table gives the medians and the median of the per-round ratios. The two sides of
every run are pinned to cores 0 and 1. perftest disables inline data on a device it does not
know (soft0 is none of its vendors), so verbs_perf runs twice: without inline data (the like for
like comparison, which judges the interposer: it must add nothing to the data path, which is
libibverbs' inline dispatch into the soft device either way) and with its default.
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

OPT_BIN = "bazel-out/k8-opt/bin/"
VERBS_PERF = OPT_BIN + "bench/verbs_perf"
SOFT_VERBS = OPT_BIN + "transport/soft_verbs/libswirl_soft_verbs.so"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def verbs_perf(test, size, iters, inline):
    cmd = [VERBS_PERF, "--test", test, "--size", str(size), "--iters", str(iters), "--json",
           "--inline=%s" % ("true" if inline else "false")]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["rtt_p50_us"] if test.endswith("_lat") else result["bw_avg_mib_per_s"]


def perftest(program, size, iters):
    """One perftest run between two processes; its result (RTT in us, or MiB/s)."""
    port = str(free_port())
    env = dict(os.environ, LD_PRELOAD=os.path.abspath(SOFT_VERBS))
    args = [program, "-d", "soft0", "-x", "0", "-s", str(size), "-n", str(iters), "-p", port]
    server = subprocess.Popen(["taskset", "-c", "1"] + args, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    client = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        client = subprocess.run(["taskset", "-c", "0"] + args + ["127.0.0.1"], env=env,
                                capture_output=True, text=True, timeout=120)
        if "Couldn't connect" not in client.stdout + client.stderr:
            break
        time.sleep(0.05)
    server_out, _ = server.communicate(timeout=120)
    if client is None or client.returncode != 0 or server.returncode != 0:
        raise RuntimeError("%s failed:\n%s\n%s" % (program, client and client.stdout,
                                                   server_out))
    line = re.search(r"^\s*%d\s+%d\s+(.*)$" % (size, iters), client.stdout, re.M)
    if line is None:
        raise RuntimeError("%s printed no result line:\n%s" % (program, client.stdout))
    numbers = [float(x) for x in line.group(1).split()]
    if program.endswith("_lat"):
        return 2 * numbers[2]  # t_typical is half a round trip
    return numbers[1]  # BW average [MB/sec], perftest's MB being 2^20 bytes


def rows(quick):
    lat_iters = 20000 if quick else 100000
    bw_iters = {64: 200000 if quick else 1000000, 1 << 20: 2000 if quick else 10000}
    yield ("64 B SEND/RECV round trip, us", "lat",
           lambda: perftest("ib_send_lat", 64, lat_iters),
           lambda: verbs_perf("send_lat", 64, lat_iters, False),
           lambda: verbs_perf("send_lat", 64, lat_iters, True))
    for size in (64, 1 << 20):
        yield ("%s RDMA WRITE bandwidth, MiB/s" % ("64 B" if size == 64 else "1 MiB"), "bw",
               lambda s=size: perftest("ib_write_bw", s, bw_iters[s]),
               lambda s=size: verbs_perf("write_bw", s, bw_iters[s], False),
               lambda s=size: verbs_perf("write_bw", s, bw_iters[s], True))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="shorter runs (a smoke test)")
    p.add_argument("--json", action="store_true", help="print one JSON object, not Markdown")
    args = p.parse_args()
    for path in (VERBS_PERF, SOFT_VERBS):
        if not os.path.exists(path):
            sys.exit("%s is missing: bazel build -c opt //bench:verbs_perf "
                     "//transport/soft_verbs:libswirl_soft_verbs.so" % path)
    table = list(rows(args.quick))
    samples = {name: [] for name, *_ in table}
    for r in range(args.rounds):
        order = table[r % len(table):] + table[:r % len(table)]
        for name, _, perf, plain, inline in order:
            runs = [perf, plain, inline] if r % 2 == 0 else [inline, plain, perf]
            values = {}
            for fn in runs:
                values[fn] = fn()
            samples[name].append((values[perf], values[plain], values[inline]))
    report = []
    for name, kind, *_ in table:
        s = samples[name]
        # The ratio that judges: perftest over verbs_perf without inline, both as RTT (lower is
        # better) or as bandwidth (higher is better).
        ratios = [a / b for a, b, _ in s]
        report.append({
            "row": name, "kind": kind,
            "perftest": statistics.median(a for a, _, _ in s),
            "verbs_perf_no_inline": statistics.median(b for _, b, _ in s),
            "verbs_perf": statistics.median(c for _, _, c in s),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "rounds": len(s),
        })
    if args.json:
        print(json.dumps(report))
        return
    print("| measurement | perftest on soft0 | verbs_perf, no inline | ratio (median of "
          "rounds; min-max) | verbs_perf, inline |")
    print("|---|---|---|---|---|")
    for r in report:
        fmt = "%.3f" if r["kind"] == "lat" else "%.0f"
        print("| %s | %s | %s | %.2f (%.2f-%.2f) | %s |" % (
            r["row"], fmt % r["perftest"], fmt % r["verbs_perf_no_inline"], r["ratio_median"],
            r["ratio_min"], r["ratio_max"], fmt % r["verbs_perf"]))
    print("\n%d rounds; latency ratio: perftest RTT / verbs_perf RTT (target at most 1.2); "
          "bandwidth ratio: perftest / verbs_perf (target at least 0.8)." % args.rounds)


if __name__ == "__main__":
    main()
