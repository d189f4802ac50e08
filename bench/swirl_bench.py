#!/usr/bin/env python3
"""`./swirl bench`: swirl beside its peers on this machine, in one table.

  ./swirl bench                      # about five minutes: bench-results/latest.{md,json}
  ./swirl bench --quick              # about one minute
  ./swirl bench --only rpc,grpc      # some rows (ids or groups; --list shows them)
  ./swirl bench --plots docs/bench   # the table, then size sweeps and the plots (PNG, SVG)
  ./swirl bench --install-peers      # apt-get install the peers first (ucx-utils, libfabric-bin,
                                     # libucx-dev for ./swirl bench ucx_connect)

Rows alternate in rounds: each round runs every row once, in an order that rotates from round to
round (and reverses on odd rounds), because this VM changes speed within seconds. A row's
percentiles come from all its rounds' samples together (histograms merged); its ratios are the
median over rounds of the per-round ratio to the shared-memory floor and to the soft device's
verbs SEND/RECV round trip measured in the same round, which is why those two rows always run.

Every row is a round trip (request out, answer back), except where it says otherwise. Peers are
run with their own tools, which report what they report: perftest's -H gives every sample;
ucx_perftest 1.13 reports a median over its last 2,048 iterations and a mean; fi_pingpong a
mean only. Cells a tool does not report say "n/r".

The machine (CPU model, cores, kernel), the date, swirl's commit and every exact command go with
the table; the JSON beside it has every round, the merged histograms and the sweeps (--plots).
"""

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPT_BIN = "bazel-out/k8-opt/bin"
SOFT_VERBS_LIB = "transport/soft_verbs/libswirl_soft_verbs.so"

CLIENT_CORE, SERVER_CORE = 0, 1

# ---- base/histogram.h's buckets, in Python ---------------------------------------------------
# Values below 256 have their own bucket; above, 128 equal buckets per power of two. The tools
# print [lower, count] pairs; merging adds counts per lower edge.

SUB_BUCKET_BITS = 7
SUB_BUCKETS = 1 << SUB_BUCKET_BITS
MAX_RELATIVE_ERROR = 1.0 / (2 * SUB_BUCKETS)


def bucket_lower(v):
    """The lower edge of the bucket holding integer v (base/histogram.h's Lower(Index(v)))."""
    if v < 2 * SUB_BUCKETS:
        return v
    shift = v.bit_length() - 1 - SUB_BUCKET_BITS
    return (v >> shift) << shift


def bucket_width(lower):
    if lower < 2 * SUB_BUCKETS:
        return 1
    return 1 << (lower.bit_length() - 1 - SUB_BUCKET_BITS)


class Hist:
    """Round-trip latencies in nanoseconds, bucketed as base/histogram.h does."""

    def __init__(self):
        self.counts = {}
        self.n = 0
        self.min = None
        self.max = None
        self.total = 0.0

    def add(self, ns, count=1):
        ns = int(round(ns))
        lower = bucket_lower(ns)
        self.counts[lower] = self.counts.get(lower, 0) + count
        self.n += count
        self.total += ns * count
        self.min = ns if self.min is None else min(self.min, ns)
        self.max = ns if self.max is None else max(self.max, ns)

    def add_buckets(self, buckets, min_ns, max_ns, mean_ns):
        """A tool's histogram: [lower, count] pairs and its exact min, max and mean."""
        n = 0
        for lower, count in buckets:
            self.counts[lower] = self.counts.get(lower, 0) + count
            n += count
        self.n += n
        self.total += mean_ns * n
        self.min = min_ns if self.min is None else min(self.min, min_ns)
        self.max = max_ns if self.max is None else max(self.max, max_ns)

    def merge(self, other):
        if other.n == 0:
            return
        for lower, count in other.counts.items():
            self.counts[lower] = self.counts.get(lower, 0) + count
        self.n += other.n
        self.total += other.total
        self.min = other.min if self.min is None else min(self.min, other.min)
        self.max = other.max if self.max is None else max(self.max, other.max)

    def percentile(self, q):
        """Nearest rank, reported as the bucket's midpoint clamped to [min, max] (ns)."""
        if self.n == 0:
            return None
        rank = min(max(math.ceil(q * self.n), 1), self.n)
        if rank == self.n:
            return self.max
        seen = 0
        for lower in sorted(self.counts):
            seen += self.counts[lower]
            if seen >= rank:
                mid = lower + (bucket_width(lower) - 1) // 2
                return min(max(mid, self.min), self.max)
        return self.max

    def mean(self):
        return self.total / self.n if self.n else None

    def cdf(self):
        """[(value_ns, fraction at or below)], one point per bucket (its top)."""
        out, seen = [], 0
        for lower in sorted(self.counts):
            seen += self.counts[lower]
            out.append((min(lower + bucket_width(lower) - 1, self.max), seen / self.n))
        return out

    def to_json(self):
        return {"unit": "ns", "sub_bucket_bits": SUB_BUCKET_BITS, "n": self.n, "min": self.min,
                "max": self.max, "mean": self.mean(),
                "buckets": [[k, self.counts[k]] for k in sorted(self.counts)]}


# ---- Running things -----------------------------------------------------------------------------

class RowFailed(Exception):
    pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_text(argv, env):
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return (prefix + " " if prefix else "") + " ".join(shlex.quote(a) for a in argv)


def run_json(argv, env, timeout):
    """Runs one of swirl's tools (--json); its last line is one JSON object."""
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **env}, cwd=ROOT)
    except subprocess.TimeoutExpired:
        raise RowFailed(f"timed out after {timeout} s")
    if p.returncode != 0:
        raise RowFailed(f"exit status {p.returncode}: {(p.stderr or p.stdout).strip()[-300:]}")
    lines = p.stdout.strip().splitlines()
    if not lines:
        raise RowFailed("printed nothing")
    return json.loads(lines[-1])


def run_pair(server_argv, client_argv, env, timeout, ready_retry):
    """A peer tool's two processes, pinned: server on SERVER_CORE, client on CLIENT_CORE. The
    client is retried while `ready_retry(output)` says the server was not listening yet. The
    server writes to a file, never a pipe: perftest's server prints its -H histogram before
    its last handshake with the client, and a full pipe would stop both."""
    full_env = {**os.environ, **env}
    with tempfile.TemporaryFile(mode="w+") as server_log:
        server = subprocess.Popen(["taskset", "-c", str(SERVER_CORE)] + server_argv, env=full_env,
                                  stdout=server_log, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        client = None
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    client = subprocess.run(["taskset", "-c", str(CLIENT_CORE)] + client_argv,
                                            env=full_env, capture_output=True, text=True,
                                            timeout=max(1.0, deadline - time.monotonic()), cwd=ROOT)
                except subprocess.TimeoutExpired:
                    raise RowFailed(f"the client timed out after {timeout:g} s")
                out = client.stdout + client.stderr
                if client.returncode == 0 or not ready_retry(out) or time.monotonic() > deadline:
                    break
                if server.poll() is not None:
                    break
                time.sleep(0.05)
            try:
                server.wait(timeout=max(2.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if client.returncode == 0:
                    raise RowFailed("the server did not exit after the client finished")
            if client.returncode != 0:
                raise RowFailed(f"client exit status {client.returncode}: "
                                f"{(client.stdout + client.stderr).strip()[-300:]}")
            server_log.seek(0)
            return client.stdout, server_log.read()
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


def sample_from_swirl_json(j, size):
    """One run of a swirl tool: its histogram, rates and keys."""
    h = Hist()
    hist = j.get("histogram")
    if not hist or not hist.get("buckets"):
        raise RowFailed("the run measured nothing (no latency histogram)")
    if hist:
        h.add_buckets(hist["buckets"], round(j["rtt_min_us"] * 1000), round(j["rtt_max_us"] * 1000),
                      j["rtt_avg_us"] * 1000)
    s = {"hist": h, "ops_per_s": j.get("ops_per_s"), "size": size, "json": j}
    if "gbytes_per_s" in j:
        s["gbytes_per_s"] = j["gbytes_per_s"]
    return s


# ---- Rows -----------------------------------------------------------------------------------------

class Row:
    """One line of the table: how to run it once (`run(seconds, state)` -> sample) and what it
    needs."""

    def __init__(self, rid, group, label, run, needs=(), package=None, unit="rtt",
                 size=64, note="", table="main"):
        self.id, self.group, self.label = rid, group, label
        self.run_fn, self.needs, self.package = run, needs, package
        self.unit, self.size, self.note, self.table = unit, size, note, table
        self.samples, self.errors = [], []
        self.rounds = []   # per round: sample or None
        self.commands = []
        self.state = {}

    def missing(self):
        for need in self.needs:
            if os.path.isabs(need) or "/" in need:
                if not os.path.exists(os.path.join(ROOT, need)):
                    return need
            elif shutil.which(need) is None:
                return need
        return None


def swirl_tool(binary, args, env=None, size=64):
    def run(ctx, seconds, state):
        argv = [os.path.join(ctx.bin, "bench", binary)] + args + [
            "-D", f"{seconds:g}", "--json", f"--client_core={CLIENT_CORE}",
            f"--server_core={SERVER_CORE}"]
        e = dict(env or {})
        if binary != "grpc_echo_perf":
            e.setdefault("SWIRL_DEVICE", "soft0")
        state["command"] = command_text(argv, e)
        return sample_from_swirl_json(run_json(argv, e, peer_timeout(seconds)), size)
    return run


def peer_timeout(seconds):
    """A peer's run may take this long before its round counts as failed (a hung tool must not
    eat the whole run)."""
    return 30 + 20 * seconds


def adaptive_iters(state, seconds, nominal_us, floor=50, cap=5_000_000):
    """Iterations for a tool without a duration option: aimed at `seconds` from the last
    round's mean round trip (or `nominal_us` the first time)."""
    if "mean_us" in state:
        return int(min(max(seconds * 1e6 / max(state["mean_us"], 0.01), floor), cap))
    # The first run only calibrates: a tenth of the time at the nominal speed, since a loaded
    # host can make a round trip tens of times slower than nominal.
    return int(min(max(seconds * 1e5 / nominal_us, floor), cap))


def perftest(program, size, nominal_us):
    """perftest on soft0 through the interposer; -H prints every sample (one-way, sorted)."""
    def run(ctx, seconds, state):
        n = adaptive_iters(state, seconds, nominal_us, floor=100, cap=2_000_000)
        port = str(free_port())
        lib = os.path.join(ROOT, ctx.bin, SOFT_VERBS_LIB)
        env = {"LD_PRELOAD": lib}
        if "TSAN_OPTIONS" in os.environ:
            # A TSan build of the library (--config=tsan, the smoke test): TSan's runtime goes
            # first, ahead of perftest's libc, or its interceptors are not the ones called.
            env["LD_PRELOAD"] = "libtsan.so.2:" + lib
        args = [program, "-d", "soft0", "-x", "0", "-s", str(size), "-n", str(n), "-p", port, "-H"]
        state["command"] = (command_text(["taskset", "-c", str(SERVER_CORE)] + args, env) + "  &&  " +
                            command_text(["taskset", "-c", str(CLIENT_CORE)] + args + ["127.0.0.1"], env))
        out, _ = run_pair(args, args + ["127.0.0.1"], env, peer_timeout(seconds),
                          lambda o: "Couldn't connect" in o or "Unable to connect" in o)
        h = Hist()
        # perftest prints one-way samples ("#, usec" lines); read_lat's are full round trips.
        factor = 1000.0 if program == "ib_read_lat" else 2000.0
        for m in re.finditer(r"^\d+, ([0-9.]+)$", out, re.M):
            h.add(float(m.group(1)) * factor)
        if h.n == 0:
            raise RowFailed(f"{program} printed no samples:\n{out[-300:]}")
        state["mean_us"] = h.mean() / 1000
        return {"hist": h, "ops_per_s": 1e9 / h.mean(), "size": size}
    return run


def ucx(test, tls, size, nominal_us):
    """ucx_perftest: the median of its last 2,048 iterations and the mean (one-way, doubled)."""
    def run(ctx, seconds, state):
        n = adaptive_iters(state, seconds, nominal_us, floor=1000, cap=5_000_000)
        port = str(free_port())
        env = {"UCX_TLS": tls}
        common = ["ucx_perftest", "-t", test, "-s", str(size), "-n", str(n),
                  "-w", str(max(n // 10, 100)), "-p", port]
        state["command"] = (command_text(common + ["-c", str(SERVER_CORE)], env) + "  &&  " +
                            command_text(common + ["-c", str(CLIENT_CORE), "127.0.0.1"], env))
        # ucx_perftest pins itself (-c); taskset as well, so the launch matches.
        out, _ = run_pair(common + ["-c", str(SERVER_CORE)],
                          common + ["-c", str(CLIENT_CORE), "127.0.0.1"], env, peer_timeout(seconds),
                          lambda o: "Connection refused" in o)
        final = [l for l in out.splitlines() if l.startswith("Final:")]
        if not final:
            raise RowFailed("ucx_perftest printed no Final: line:\n" + out[-300:])
        cols = final[0].split()
        p50_us, mean_us = 2 * float(cols[2]), 2 * float(cols[3])
        state["mean_us"] = mean_us
        return {"p50_us": p50_us, "mean_us": mean_us, "ops_per_s": 1e6 / mean_us, "size": size}
    return run


def fi_pingpong(provider, endpoint, size, nominal_us):
    """fi_pingpong: usec/xfer is the mean one-way time (its pings and pongs), doubled."""
    def run(ctx, seconds, state):
        n = adaptive_iters(state, seconds, nominal_us, floor=1000, cap=5_000_000)
        port = str(free_port())
        common = ["fi_pingpong", "-p", provider, "-e", endpoint, "-I", str(n), "-S", str(size)]
        server = common + ["-B", port]
        client = common + ["-P", port, "127.0.0.1"]
        state["command"] = (command_text(["taskset", "-c", str(SERVER_CORE)] + server, {}) + "  &&  " +
                            command_text(["taskset", "-c", str(CLIENT_CORE)] + client, {}))
        out, _ = run_pair(server, client, {}, peer_timeout(seconds),
                          lambda o: "Connection refused" in o or "fi_getinfo" in o or "-61" in o)
        rows = [l.split() for l in out.splitlines() if re.match(r"^\d+[kmg]?\s+\S+\s+=", l)]
        if not rows:
            raise RowFailed("fi_pingpong printed no result line:\n" + out[-300:])
        mean_us = 2 * float(rows[-1][6])
        state["mean_us"] = mean_us
        return {"mean_us": mean_us, "ops_per_s": 1e6 / mean_us, "size": size}
    return run


def bulk_rows():
    rows = []
    for size, tag in ((4096, "4k"), (65536, "64k"), (1 << 20, "1m")):
        for mode, mtag, what in (("server-exposes", "remote", "window + SEND_WITH_INV"),
                                 ("server-exposes+local-inv", "local", "window + LOCAL_INV fallback")):
            label = f"swirl bulk download {tag.upper().replace('K', ' KiB').replace('M', ' MiB')}, {what}"
            rows.append(Row(f"bulk_{tag}_{mtag}", "bulk", label,
                            swirl_tool("rpc_perf", ["--test", "bulk_read", "-s", str(size),
                                                    "--inflight", "1", "--bulk_mode", mode],
                                       size=size),
                            needs=[f"{OPT_BIN}/bench/rpc_perf"], unit="gbs", size=size))
    return rows


def window_rows():
    rows = []
    for test, label in (("static_mr", "one registered region, no window (baseline)"),
                        ("bind_inv", "bind a type 2 window, revoked by the peer's SEND_WITH_INV"),
                        ("bind_local_inv", "bind a type 2 window, revoked by LOCAL_INV"),
                        ("reg_mr", "register and deregister an MR per transfer")):
        rows.append(Row(f"mw_{test}", "windows", f"4 KiB exposed transfer: {label}",
                        swirl_tool("verbs_perf", ["--test", test, "-s", "4096"], size=4096),
                        needs=[f"{OPT_BIN}/bench/verbs_perf"], table="windows", size=4096))
    return rows


def all_rows():
    V, R, G = f"{OPT_BIN}/bench/verbs_perf", f"{OPT_BIN}/bench/rpc_perf", f"{OPT_BIN}/bench/grpc_echo_perf"
    L = f"{OPT_BIN}/{SOFT_VERBS_LIB}"
    rows = [
        Row("floor", "floor", "shared-memory cache-line ping-pong (the floor)",
            swirl_tool("verbs_perf", ["--raw"]), needs=[V]),
        Row("verbs_send", "verbs", "soft device verbs SEND/RECV 64 B",
            swirl_tool("verbs_perf", ["--test", "send_lat", "-s", "64"]), needs=[V]),
        Row("verbs_write", "verbs", "soft device RDMA WRITE 64 B (ping-pong)",
            swirl_tool("verbs_perf", ["--test", "write_lat", "-s", "64"]), needs=[V]),
        Row("verbs_read", "verbs", "soft device RDMA READ 64 B",
            swirl_tool("verbs_perf", ["--test", "read_lat", "-s", "64"]), needs=[V]),
        Row("perftest_send", "perftest", "perftest ib_send_lat 64 B on soft0 (interposer)",
            perftest("ib_send_lat", 64, 0.5), needs=["ib_send_lat", L], package="perftest"),
        Row("perftest_write", "perftest", "perftest ib_write_lat 64 B on soft0 (interposer)",
            perftest("ib_write_lat", 64, 25), needs=["ib_write_lat", L], package="perftest",
            note="the target spins on memory, so the soft device answers late (docs/SOFT_VERBS.md)"),
        Row("perftest_read", "perftest", "perftest ib_read_lat 64 B on soft0 (interposer)",
            perftest("ib_read_lat", 64, 1.0), needs=["ib_read_lat", L], package="perftest"),
        Row("rpc_raw", "rpc", "swirl RPC raw-bytes echo 64 B",
            swirl_tool("rpc_perf", ["--test", "latency", "--raw", "-s", "64"]), needs=[R]),
        Row("rpc_proto", "rpc", "swirl RPC protobuf echo 64 B",
            swirl_tool("rpc_perf", ["--test", "latency", "-s", "64"]), needs=[R]),
    ] + bulk_rows() + [
        Row("grpc", "grpc", "gRPC C++ unary protobuf echo 64 B, TCP loopback",
            swirl_tool("grpc_echo_perf", ["-s", "64"]), needs=[G]),
        Row("ucx_am_shm", "ucx", "UCX ucp_am_lat 64 B, posix shared memory",
            ucx("ucp_am_lat", "posix,self", 64, 0.5), needs=["ucx_perftest"], package="ucx-utils"),
        Row("ucx_tag_shm", "ucx", "UCX tag_lat 64 B, posix shared memory",
            ucx("tag_lat", "posix,self", 64, 0.5), needs=["ucx_perftest"], package="ucx-utils"),
        Row("ucx_am_tcp", "ucx", "UCX ucp_am_lat 64 B, TCP loopback",
            ucx("ucp_am_lat", "tcp,self", 64, 15), needs=["ucx_perftest"], package="ucx-utils"),
        Row("ucx_tag_tcp", "ucx", "UCX tag_lat 64 B, TCP loopback",
            ucx("tag_lat", "tcp,self", 64, 15), needs=["ucx_perftest"], package="ucx-utils"),
        Row("fi_shm", "libfabric", "libfabric fi_pingpong 64 B, shm provider",
            fi_pingpong("shm", "rdm", 64, 1.0), needs=["fi_pingpong"], package="libfabric-bin"),
        Row("fi_tcp", "libfabric", "libfabric fi_pingpong 64 B, tcp provider",
            fi_pingpong("tcp", "msg", 64, 15), needs=["fi_pingpong"], package="libfabric-bin"),
    ] + window_rows()
    return rows


REFERENCE_ROWS = ("floor", "verbs_send")

# ---- Rounds and summaries ------------------------------------------------------------------------


class Ctx:
    def __init__(self, bin_dir):
        self.bin = bin_dir


def p50_of(sample):
    """A sample's median round trip in us, and whether it is a mean standing in for it."""
    if sample is None:
        return None, False
    if "hist" in sample and sample["hist"].n:
        return sample["hist"].percentile(0.5) / 1000.0, False
    if "p50_us" in sample:
        return sample["p50_us"], False
    if "mean_us" in sample:
        return sample["mean_us"], True
    return None, False


def run_rounds(rows, rounds, seconds, ctx, log):
    active = [r for r in rows if r.status == "ok"]
    for rnd in range(rounds):
        k = rnd % max(len(active), 1)
        order = active[k:] + active[:k]
        if rnd % 2:
            order.reverse()
        log(f"round {rnd + 1}/{rounds}: " + " ".join(r.id for r in order))
        results = {}
        for row in order:
            try:
                sample = row.run_fn(ctx, seconds, row.state)
                results[row.id] = sample
                row.samples.append(sample)
                if row.state.get("command") and row.state["command"] not in row.commands:
                    row.commands = [row.state["command"]]  # the last one: counts adapt
                if "hist" in sample and sample["hist"].n:
                    row.state["mean_us"] = sample["hist"].mean() / 1000
            except (RowFailed, json.JSONDecodeError, KeyError, ValueError) as e:
                row.errors.append(f"round {rnd + 1}: {e}")
                results[row.id] = None
                log(f"  {row.id} failed: {e}")
        for row in rows:
            row.rounds.append(results.get(row.id))


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(row, floor_row, verbs_row, static_row=None):
    s = {"id": row.id, "group": row.group, "label": row.label, "table": row.table,
         "size": row.size, "status": row.status, "package": row.package, "note": row.note,
         "commands": row.commands, "errors": row.errors, "rounds_ok": len(row.samples)}
    if row.status != "ok" or not row.samples:
        if row.status == "ok":
            s["status"] = "failed"
        return s
    merged = Hist()
    for smp in row.samples:
        if "hist" in smp:
            merged.merge(smp["hist"])
    if merged.n:
        s.update({q: merged.percentile(v) / 1000.0 for q, v in
                  (("p50_us", 0.5), ("p99_us", 0.99), ("p999_us", 0.999), ("p9999_us", 0.9999))})
        s["max_us"] = merged.max / 1000.0
        s["mean_us"] = merged.mean() / 1000.0
        s["samples"] = merged.n
        s["histogram"] = merged.to_json()
        s["p50_is_mean"] = False
    else:
        p50s = [smp.get("p50_us") for smp in row.samples if smp.get("p50_us") is not None]
        means = [smp["mean_us"] for smp in row.samples if smp.get("mean_us") is not None]
        s["p50_us"] = median(p50s) if p50s else median(means)
        s["p50_is_mean"] = not p50s
        s["mean_us"] = median(means)
    s["ops_per_s"] = median([smp.get("ops_per_s") for smp in row.samples])
    if row.unit == "gbs":
        s["gbytes_per_s"] = median([smp.get("gbytes_per_s") for smp in row.samples])
    # Per-round ratios: this row's median against the floor's and the verbs round trip's, both
    # measured in the same round.
    for key, ref in (("ratio_floor", floor_row), ("ratio_verbs", verbs_row)):
        ratios = []
        for mine, theirs in zip(row.rounds, ref.rounds if ref else []):
            a, _ = p50_of(mine)
            b, _ = p50_of(theirs)
            if a is not None and b:
                ratios.append(a / b)
        s[key] = median(ratios)
        s[key + "_rounds"] = len(ratios)
    if row.table == "windows":
        js = [smp["json"] for smp in row.samples if "json" in smp]
        s["window_ns"] = median([j.get("window_ns") for j in js])
        s["windows_per_s_per_core"] = median([j.get("windows_per_s_per_core") for j in js])
        if static_row is not None and row is not static_row:
            added = []
            for mine, base in zip(row.rounds, static_row.rounds):
                a, _ = p50_of(mine)
                b, _ = p50_of(base)
                if a is not None and b is not None:
                    added.append(a - b)
            s["added_p50_us"] = median(added)
    s["per_round_p50_us"] = [p50_of(smp)[0] for smp in row.rounds]
    return s


# ---- Sweeps (--plots) ------------------------------------------------------------------------------

SWEEP_SIZES = [64, 256, 1024, 4096, 16384, 65536, 262144, 1048576]
BULK_SIZES = [4096, 16384, 65536, 262144, 1048576, 4194304]


def sweep_systems():
    V, R, G = f"{OPT_BIN}/bench/verbs_perf", f"{OPT_BIN}/bench/rpc_perf", f"{OPT_BIN}/bench/grpc_echo_perf"
    return [
        ("soft device verbs SEND/RECV", [V], lambda s: swirl_tool("verbs_perf", ["--test", "send_lat", "-s", str(s)], size=s)),
        ("soft device RDMA READ", [V], lambda s: swirl_tool("verbs_perf", ["--test", "read_lat", "-s", str(s)], size=s)),
        ("swirl RPC raw bytes", [R], lambda s: swirl_tool("rpc_perf", ["--test", "latency", "--raw", "-s", str(s)], size=s)),
        ("swirl RPC protobuf", [R], lambda s: swirl_tool("rpc_perf", ["--test", "latency", "-s", str(s)], size=s)),
        ("gRPC unary, TCP", [G], lambda s: swirl_tool("grpc_echo_perf", ["-s", str(s)], size=s)),
        ("UCX ucp_am_lat, shm", ["ucx_perftest"], lambda s: ucx("ucp_am_lat", "posix,self", s, 0.5 + s / 5000)),
        ("UCX ucp_am_lat, TCP", ["ucx_perftest"], lambda s: ucx("ucp_am_lat", "tcp,self", s, 15 + s / 500)),
        ("libfabric shm", ["fi_pingpong"], lambda s: fi_pingpong("shm", "rdm", s, 1 + s / 2000)),
        ("libfabric tcp", ["fi_pingpong"], lambda s: fi_pingpong("tcp", "msg", s, 15 + s / 500)),
    ]


def run_sweeps(ctx, seconds, reps, log):
    out = {"sizes": {}, "bulk": {}}
    for name, needs, make in sweep_systems():
        probe = Row("x", "x", name, None, needs=[n.replace(OPT_BIN, ctx.bin) for n in needs])
        if probe.missing():
            log(f"sweep: {name}: {probe.missing()} not installed, skipped")
            continue
        points = []
        for size in SWEEP_SIZES:
            state = {}
            try:
                smp = make(size)(ctx, seconds, state)
            except RowFailed as e:
                log(f"sweep: {name} {size} B failed: {e}")
                continue
            p50, is_mean = p50_of(smp)
            ops = smp.get("ops_per_s")
            points.append({"size": size, "p50_us": p50, "p50_is_mean": is_mean,
                           "gbytes_per_s": ops * size / 1e9 if ops else None,
                           "command": state.get("command")})
        out["sizes"][name] = points
        log(f"sweep: {name}: {len(points)} sizes")
    R = os.path.join(ctx.bin, "bench", "rpc_perf")
    modes = (("server-exposes", "window + SEND_WITH_INV"),
             ("server-exposes+local-inv", "window + LOCAL_INV fallback"),
             ("mirror", "client's window (mirror) + SEND_WITH_INV"))
    if os.path.exists(os.path.join(ROOT, R)):
        for test in ("bulk_read", "bulk_write"):
            results = {label: [] for _, label in modes}
            for size in BULK_SIZES:
                # The three modes take turns, `reps` times (rotating), and each point is the
                # median: one short run per point is at the machine's mercy.
                runs = {label: [] for _, label in modes}
                for rep in range(reps):
                    order = modes[rep % 3:] + modes[:rep % 3]
                    for mode, label in order:
                        state = {}
                        try:
                            smp = swirl_tool("rpc_perf", ["--test", test, "-s", str(size), "--inflight", "8",
                                                          "--bulk_mode", mode], size=size)(ctx, seconds, state)
                            runs[label].append((smp.get("gbytes_per_s"), p50_of(smp)[0], state.get("command")))
                        except RowFailed as e:
                            log(f"sweep: {test} {mode} {size} failed: {e}")
                for _, label in modes:
                    if runs[label]:
                        results[label].append({"size": size,
                                               "gbytes_per_s": median([r[0] for r in runs[label]]),
                                               "p50_us": median([r[1] for r in runs[label]]),
                                               "runs": len(runs[label]), "command": runs[label][-1][2]})
                log(f"sweep: {test} {size} B: " + ", ".join(
                    f"{label} {results[label][-1]['gbytes_per_s']:.2f} GB/s" for _, label in modes if results[label]))
            out["bulk"][test] = results
    return out


# ---- Output -------------------------------------------------------------------------------------------

def machine():
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    osname = ""
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    osname = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    virt = ""
    try:
        virt = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "kernel": platform.release(), "os": osname,
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "virtualization": virt or "unknown", "rdma_devices": sorted(os.listdir("/sys/class/infiniband"))
            if os.path.isdir("/sys/class/infiniband") else []}


def commit():
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, cwd=ROOT).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=ROOT).stdout.strip()
        return rev + ("+changes" if dirty else "") if rev else "unknown"
    except OSError:
        return "unknown"


def fmt_us(v):
    if v is None:
        return "n/r"
    if v >= 1000:
        return f"{v / 1000:.2f} ms"
    if v >= 100:
        return f"{v:.0f} us"
    if v >= 10:
        return f"{v:.1f} us"
    return f"{v:.3f} us" if v < 1 else f"{v:.2f} us"


def fmt_rate(s):
    if s.get("gbytes_per_s") is not None:
        return f"{s['gbytes_per_s']:.2f} GB/s"
    ops = s.get("ops_per_s")
    if ops is None:
        return "n/r"
    if ops >= 1e6:
        return f"{ops / 1e6:.2f} M/s"
    return f"{ops / 1e3:.0f} k/s" if ops >= 1e4 else f"{ops:.0f}/s"


def fmt_ratio(v):
    return "n/r" if v is None else (f"{v:.2f}x" if v < 100 else f"{v:.0f}x")


def markdown(report):
    m = report["machine"]
    out = [f"# swirl bench, {report['date']} (commit {report['commit']})", "",
           f"Machine: {m['cpu']}, {m['cores']} cores, kernel {m['kernel']}, {m['os']}, "
           f"virtualization {m['virtualization']}, RDMA devices: "
           f"{', '.join(m['rdma_devices']) or 'none (the soft device)'}; load average "
           f"{' / '.join(str(x) for x in m.get('load_average', []))} (1/5/15 min) when it started "
           f"(other work on the machine shows there). Client pinned to core {CLIENT_CORE}, server "
           f"to core {SERVER_CORE}.",
           f"{report['rounds']} rounds of {report['seconds']:g} s per row; rows alternate within each "
           "round. Round trips; percentiles over all rounds' samples; ratios are medians of "
           "per-round ratios to the floor and to the verbs SEND/RECV round trip of the same round.", "",
           "| row | p50 | p99 | p99.9 | p99.99 | max | throughput | / floor | / verbs RTT |",
           "|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for s in report["rows"]:
        if s["table"] != "main":
            continue
        if s["status"] == "not installed":
            out.append(f"| {s['label']} | not installed (`apt-get install {s['package']}`, or "
                       f"`./swirl bench --install-peers`) | | | | | | | |")
            continue
        if s["status"] != "ok":
            out.append(f"| {s['label']} | {s['status']}: {'; '.join(s['errors'])[:200]} | | | | | | | |")
            continue
        p50 = fmt_us(s.get("p50_us")) + (" (mean)" if s.get("p50_is_mean") else "")
        cells = [s["label"], p50] + [fmt_us(s.get(k)) for k in ("p99_us", "p999_us", "p9999_us", "max_us")]
        cells += [fmt_rate(s), fmt_ratio(s.get("ratio_floor")), fmt_ratio(s.get("ratio_verbs"))]
        out.append("| " + " | ".join(cells) + " |")
        if s.get("note"):
            notes.append(f"* {s['label']}: {s['note']}.")
    windows = [s for s in report["rows"] if s["table"] == "windows"]
    if windows:
        out += ["", "Exposing memory per request (`verbs_perf --test static_mr|bind_inv|bind_local_inv|reg_mr -s 4096`): "
                "the client exposes a 4 KiB buffer per transfer, the server RDMA READs it and answers. "
                "\"adds\" is the median over rounds of this row's p50 minus the baseline's; \"window steps\" "
                "is the exposing side's own time in bind / LOCAL_INV / reg+dereg per window.", "",
                "| exposed transfer | p50 | p99 | p99.99 | transfers/s | adds to a transfer | window steps | windows/s per core |",
                "|---|---|---|---|---|---|---|---|"]
        for s in windows:
            if s["status"] != "ok":
                out.append(f"| {s['label']} | {s['status']} | | | | | | |")
                continue
            wn = s.get("window_ns")
            added = s.get("added_p50_us")
            out.append("| " + " | ".join([
                s["label"], fmt_us(s.get("p50_us")), fmt_us(s.get("p99_us")), fmt_us(s.get("p9999_us")),
                fmt_rate({"ops_per_s": s.get("ops_per_s")}),
                "-" if added is None else f"{added * 1000:+.0f} ns",
                "-" if not wn else f"{wn:.0f} ns",
                "-" if not s.get("windows_per_s_per_core") else f"{s['windows_per_s_per_core'] / 1e6:.2f} M"]) + " |")
    out += ["", "n/r: not reported by that tool (ucx_perftest 1.13: a median of its last 2,048 "
            "iterations and a mean; fi_pingpong: a mean). UCX and libfabric figures are their one-way "
            "times doubled; perftest's -H samples likewise (except ib_read_lat, a round trip)."]
    out += notes
    out += ["", "Commands (the last round's; iteration counts of the peers adapt to the run length):", ""]
    for s in report["rows"]:
        for c in s.get("commands", []):
            out.append(f"* `{s['id']}`: `{c}`")
    return "\n".join(out) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description="swirl beside its peers, in one table.")
    p.add_argument("--quick", action="store_true", help="about one minute (3 rounds, short runs)")
    p.add_argument("--only", default="", help="comma-separated row ids or groups (--list)")
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--seconds", type=float, default=None, help="measured seconds per row per round")
    p.add_argument("--out", default="bench-results", help="where latest.md and latest.json go")
    p.add_argument("--plots", default="", help="also run the size sweeps and write plots here")
    p.add_argument("--sweep_seconds", type=float, default=None)
    p.add_argument("--bin", default=OPT_BIN, help="where the opt build's binaries are")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM as Ctrl-C: subprocess.run and run_pair then end the tools they started.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    rows = all_rows()
    if args.list:
        for r in rows:
            print(f"{r.id:18} {r.group:10} {r.label}")
        return 0
    if args.only:
        wanted = {w.strip() for w in args.only.split(",") if w.strip()}
        known = {r.id for r in rows} | {r.group for r in rows}
        unknown = wanted - known
        if unknown:
            sys.exit(f"swirl bench: unknown rows {', '.join(sorted(unknown))} (--list shows them)")
        rows = [r for r in rows if r.id in wanted or r.group in wanted or r.id in REFERENCE_ROWS]
    rounds = args.rounds or (3 if args.quick else 7)
    seconds = args.seconds or (0.25 if args.quick else 0.8)
    log = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    ctx = Ctx(args.bin)
    for r in rows:
        r.needs = [n.replace(OPT_BIN, args.bin) if n.startswith(OPT_BIN) else n for n in r.needs]
        miss = r.missing()
        if miss is None:
            r.status = "ok"
        elif r.package:
            r.status = "not installed"
            log(f"{r.id}: {miss} is not installed (package {r.package})")
        else:
            r.status = f"missing {miss} (build it: bazel build -c opt //bench:all)"
    started = time.monotonic()
    run_rounds(rows, rounds, seconds, ctx, log)
    by_id = {r.id: r for r in rows}
    floor, verbs = by_id.get("floor"), by_id.get("verbs_send")
    static = by_id.get("mw_static_mr")
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(), "machine": machine(), "rounds": rounds, "seconds": seconds,
        "quick": args.quick, "elapsed_s": None,
        "rows": [summarize(r, floor, verbs, static) for r in rows],
    }
    if args.plots:
        report["sweeps"] = run_sweeps(ctx, args.sweep_seconds or (0.2 if args.quick else 0.4),
                                      1 if args.quick else 3, log)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    text = markdown(report)
    out_dir = os.path.join(ROOT, args.out) if not os.path.isabs(args.out) else args.out
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "latest.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out_dir, "latest.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(text)
    print(f"(written to {os.path.join(args.out, 'latest.md')} and latest.json; "
          f"{report['elapsed_s']:.0f} s)")
    if args.plots:
        import bench_plots  # noqa: E402 (matplotlib only when asked for)
        plots_dir = args.plots if os.path.isabs(args.plots) else os.path.join(ROOT, args.plots)
        for path in bench_plots.render(report, plots_dir):
            print(f"plot: {os.path.relpath(path, ROOT)}")
    failed = [s["id"] for s in report["rows"] if s["status"] not in ("ok", "not installed")]
    if failed:
        print(f"swirl bench: rows failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
