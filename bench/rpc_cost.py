#!/usr/bin/env python3
"""Instructions per 64-byte echo call on each side of swirl's RPC layer, counted by callgrind.

  bazel build -c opt //bench:rpc_path_bench && python3 bench/rpc_cost.py [--size 64]

bench/rpc_path_bench drives a client worker and a server worker on one thread over soft0, so
nothing spins waiting for the other side. callgrind collects only inside the measured steps:
the client's ClientStart and ClientFinish (from starting the call to its completion, the
response parsed into the caller's object) and the server's ServerTurn (from the receive
completion through the handler to the posted response, and what the turn also does: reposting
receives, send completions). Each side is one run; the cost per call is the difference between
a long and a short run, divided by the difference in calls, so setup and warm-up cancel out.

Each side's instructions are split by where the code lives:
  rpc        swirl's RPC layer: rpc/, swirl's generated code, the handler's invocation (examples/)
  protobuf   libprotobuf and protoc's generated message code (serialize, parse, Clear)
  device     the soft device: transport/, and libibverbs' inline dispatch (infiniband/verbs.h)
  other      libc, libstdc++, Abseil
"rpc" counts both the caller's and the loop's RPC work, since the client's worker is driven by
the caller here (a caller-driven channel, as rpc_perf uses); a background worker would split the
same work across two threads. Prints a Markdown table, or JSON with --json.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

BIN = "bazel-out/k8-opt/bin/bench/rpc_path_bench"
SIDES = {
    "client": ["ClientStart", "ClientFinish"],
    "server": ["ServerTurn"],
}
GROUPS = ("rpc", "protobuf", "device", "other")


def classify(file_name, obj):
    f = file_name or ""
    o = obj or ""
    # protoc's generated message code (*.pb.cc, *.pb.h: parse, serialize, Clear) is protobuf's
    # work, wherever the .proto lives; swirl's generated stubs and services (*.swirl.*) are not.
    if "protobuf" in o or "/google/protobuf/" in f or f.endswith((".pb.cc", ".pb.h")):
        return "protobuf"
    if f.startswith(("rpc/", "examples/", "tools/")) or "/examples/" in f or "/rpc/" in f:
        return "rpc"
    if f.startswith("transport/") or "/transport/" in f or "infiniband/" in f:
        return "device"
    return "other"


def run(binary, encoding, size, calls, side, work):
    out = os.path.join(work, "cg.%s.%s.%d" % (encoding, side, calls))
    toggles = ["--toggle-collect=*%s*" % fn for fn in SIDES[side]]
    # --fair-sched: valgrind runs one thread at a time, and without it the measuring thread's
    # turns can starve the soft device's HCA threads for a minute while the QPs link.
    cmd = ["valgrind", "--tool=callgrind", "--fair-sched=yes", "--collect-atstart=no",
           "--callgrind-out-file=" + out] + toggles + [
               binary, "--encoding", encoding, "--size", str(size), "--calls", str(calls)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("%s failed:\n%s" % (" ".join(cmd), p.stderr[-2000:]))
    return parse(out)


def parse(path):
    """Exclusive instructions per group, and per (group, function), from callgrind's output."""
    names = {"fl": {}, "fn": {}, "ob": {}}
    totals = {g: 0 for g in GROUPS}
    by_function = {}
    cur = {"fl": None, "ob": None, "fn": None}
    in_call = False
    with open(path) as f:
        for line in f:
            m = re.match(r"^(fl|fi|fe|fn|ob)=\((\d+)\)(?: (.*))?$", line.rstrip("\n"))
            if m:
                kind, num, name = m.group(1), m.group(2), m.group(3)
                table = "fl" if kind in ("fl", "fi", "fe") else kind
                if name is not None:
                    names[table][num] = name
                if kind in ("fl", "fi", "fe"):
                    cur["fl"] = names["fl"].get(num)
                elif kind == "ob":
                    cur["ob"] = names["ob"].get(num)
                else:
                    cur["fn"] = names["fn"].get(num)
                continue
            if re.match(r"^c(fl|fi|fe|fn|ob)=", line):
                # The callee's name table entries are defined here too.
                m = re.match(r"^c(fl|fi|fe|fn|ob)=\((\d+)\)(?: (.*))?$", line.rstrip("\n"))
                if m and m.group(3) is not None:
                    table = "fl" if m.group(1) in ("fl", "fi", "fe") else m.group(1)
                    names[table][m.group(2)] = m.group(3)
                continue
            if line.startswith("calls="):
                in_call = True  # the next cost line is the call's inclusive cost: skip it
                continue
            m = re.match(r"^(?:[+\-]?\d+|\*) (\d+)", line)
            if m:
                if in_call:
                    in_call = False
                    continue
                group = classify(cur["fl"], cur["ob"])
                totals[group] += int(m.group(1))
                key = (group, cur["fn"])
                by_function[key] = by_function.get(key, 0) + int(m.group(1))
    return totals, by_function


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--short", type=int, default=5000, help="calls in the short run")
    p.add_argument("--long", type=int, default=20000, help="calls in the long run")
    p.add_argument("--json", action="store_true")
    p.add_argument("--functions", type=int, default=0, metavar="N",
                   help="also list each side's N costliest functions per call (exclusive, by "
                        "group; code inlined into a function counts in the file it came from)")
    p.add_argument("--bin", default=BIN,
                   help="the rpc_path_bench binary (a copy of an older build, to compare)")
    args = p.parse_args()
    if not os.path.exists(args.bin):
        sys.exit("%s is missing: bazel build -c opt //bench:rpc_path_bench" % args.bin)
    work = tempfile.mkdtemp(prefix="rpc_cost-")
    report = {}
    functions = {}
    for encoding in ("raw", "proto"):
        for side in SIDES:
            short, short_fns = run(args.bin, encoding, args.size, args.short, side, work)
            long_, long_fns = run(args.bin, encoding, args.size, args.long, side, work)
            n = args.long - args.short
            per = {g: (long_[g] - short[g]) / n for g in GROUPS}
            per["total"] = sum(per[g] for g in GROUPS)
            report["%s/%s" % (encoding, side)] = per
            fns = {k: (v - short_fns.get(k, 0)) / n for k, v in long_fns.items()}
            functions["%s/%s" % (encoding, side)] = sorted(fns.items(), key=lambda kv: -kv[1])
    if args.json:
        print(json.dumps(report))
        return
    print("| %d B echo, per call | %s | total |" % (args.size, " | ".join(GROUPS)))
    print("|---|%s---|" % ("---|" * len(GROUPS)))
    for key, per in report.items():
        print("| %s | %s | %.0f |" % (key, " | ".join("%.0f" % per[g] for g in GROUPS),
                                      per["total"]))
    for key, fns in functions.items() if args.functions else ():
        print("\n%s, costliest functions per call:" % key)
        for (group, fn), cost in fns[:args.functions]:
            print("  %7.1f  %-8s %s" % (cost, group, fn))


if __name__ == "__main__":
    main()
