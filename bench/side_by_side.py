#!/usr/bin/env python3
"""Runs two benchmark commands alternately, many times, and reports their ratio.

This machine is a shared 2-vCPU VM whose speed changes by 3-4x within seconds; a ratio taken
from two runs minutes apart means little. Alternating short runs and taking the median of the
per-pair ratios compares both under the same conditions.

  side_by_side.py --pairs 15 --key rtt_p50_us \
      -- bazel-out/k8-opt/bin/bench/verbs_perf --raw --json --iters 20000 \
      -- bazel-out/k8-opt/bin/bench/verbs_perf --test send_lat --json --iters 20000

Each command must print one JSON object as its last line. Prints one JSON object with the
median of each side, the median ratio (second / first) and every pair.
"""

import argparse
import json
import statistics
import subprocess
import sys


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    argv = sys.argv[1:]
    if argv.count("--") != 2:
        sys.exit("usage: side_by_side.py [--pairs N] [--key K] -- CMD_A... -- CMD_B...")
    first = argv.index("--")
    second = argv.index("--", first + 1)
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--key", default="rtt_p50_us")
    parser.add_argument("--label_a", default="a")
    parser.add_argument("--label_b", default="b")
    args = parser.parse_args(argv[:first])
    cmd_a, cmd_b = argv[first + 1:second], argv[second + 1:]
    pairs = []
    for i in range(args.pairs):
        # Alternate which goes first, so a drift in machine speed does not favour one side.
        if i % 2 == 0:
            a, b = run(cmd_a)[args.key], run(cmd_b)[args.key]
        else:
            b, a = run(cmd_b)[args.key], run(cmd_a)[args.key]
        pairs.append((a, b))
    ratios = [b / a for a, b in pairs if a > 0]
    print(json.dumps({
        "key": args.key,
        args.label_a: statistics.median(a for a, _ in pairs),
        args.label_b: statistics.median(b for _, b in pairs),
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "pairs": [[round(a, 4), round(b, 4)] for a, b in pairs],
    }))


if __name__ == "__main__":
    main()
