#!/usr/bin/env python3
"""Plots of a `./swirl bench` report (bench/swirl_bench.py's JSON), with matplotlib (Debian's
python3-matplotlib; `./swirl bench --plots DIR` installs it):

  latency_cdf.{png,svg}     the round trip's distribution per system (log x), from the merged
                            histograms; systems whose tool reports no distribution are points
  size_latency.{png,svg}    p50 round trip against message size per system (one in flight)
  size_throughput.{png,svg} payload throughput against message size (one in flight)
  bulk_modes.{png,svg}      swirl bulk downloads and uploads: per-request windows revoked by
                            SEND_WITH_INV against the LOCAL_INV fallback and the mirror mode
                            (the client exposes), GB/s against size (8 in flight)

  python3 bench/bench_plots.py bench-results/latest.json docs/bench
"""

import json
import os
import sys

# One colour per system, the same in every plot (rows by id, sweeps by name).
COLOURS = {
    "floor": "#7f7f7f",
    "verbs_send": "#1f77b4", "soft device verbs SEND/RECV": "#1f77b4",
    "verbs_write": "#6baed6", "verbs_read": "#08306b", "soft device RDMA READ": "#08306b",
    "perftest_send": "#9467bd", "perftest_write": "#c5b0d5", "perftest_read": "#54278f",
    "rpc_raw": "#2ca02c", "swirl RPC raw bytes": "#2ca02c",
    "rpc_proto": "#006d2c", "swirl RPC protobuf": "#006d2c",
    "grpc": "#d62728", "gRPC unary, TCP": "#d62728",
    "ucx_am_shm": "#ff7f0e", "UCX ucp_am_lat, shm": "#ff7f0e", "ucx_tag_shm": "#fdae6b",
    "ucx_am_tcp": "#a63603", "UCX ucp_am_lat, TCP": "#a63603", "ucx_tag_tcp": "#e6550d",
    "fi_shm": "#8c564b", "libfabric shm": "#8c564b", "fi_tcp": "#c49c94", "libfabric tcp": "#c49c94",
}
DASHED = {"verbs_write", "perftest_write", "ucx_tag_shm", "ucx_tag_tcp", "fi_tcp"}


def colour(key):
    return COLOURS.get(key)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.grid": True,
                         "grid.alpha": 0.3, "figure.dpi": 110})
    return plt


def _save(fig, out_dir, name):
    paths = []
    for ext in ("png", "svg"):
        path = os.path.join(out_dir, f"{name}.{ext}")
        fig.savefig(path, bbox_inches="tight", metadata={"Date": None} if ext == "svg" else None)
        paths.append(path)
    return paths


def _size_label(n):
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            return f"{n // div} {unit}"
    return f"{n} B"


def _size_axis(ax, sizes):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([_size_label(n) for n in sizes], rotation=30)
    ax.minorticks_off()


def _subtitle(report):
    m = report["machine"]
    return (f"{report['date']}, commit {report['commit']}; {m['cpu']}, {m['cores']} cores; "
            f"{report['rounds']} rounds")


def latency_cdf(plt, report, out_dir):
    fig, ax = plt.subplots(figsize=(11, 5.5))
    lines = [s for s in report["rows"] if s["table"] == "main" and s["status"] == "ok"
             and s.get("histogram") and s["group"] not in ("bulk",)]
    for s in lines:
        h = s["histogram"]
        xs, ys, seen = [], [], 0
        for lower, count in h["buckets"]:
            seen += count
            xs.append(max(lower, 1) / 1000.0)
            ys.append(seen / h["n"])
        ax.step(xs, ys, where="post", label=s["label"], color=colour(s["id"]), linewidth=1.3,
                linestyle="--" if s["id"] in DASHED else "-")
    # Tools that report only a median or a mean: a marker at 0.5.
    for s in report["rows"]:
        if s["table"] == "main" and s["status"] == "ok" and not s.get("histogram") and s.get("p50_us"):
            marker = "o" if not s.get("p50_is_mean") else "s"
            ax.plot([s["p50_us"]], [0.5], marker=marker, linestyle="none", color=colour(s["id"]),
                    label=s["label"] + (" (p50 only)" if not s.get("p50_is_mean") else " (mean only)"))
    ax.set_xscale("log")
    ax.set_xlabel("round trip (us, log scale)")
    ax.set_ylabel("fraction of round trips at or below")
    ax.set_ylim(0, 1.001)
    ax.set_title("Round-trip latency, 64 B, per system\n" + _subtitle(report), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, out_dir, "latency_cdf")


def size_plots(plt, report, out_dir):
    sweeps = report.get("sweeps", {}).get("sizes", {})
    if not sweeps:
        return []
    paths = []
    for name, key, ylabel, title in (
            ("size_latency", "p50_us", "p50 round trip (us, log)", "Round trip against message size, one in flight"),
            ("size_throughput", "gbytes_per_s", "payload GB/s, one direction (log)",
             "Throughput against message size, one message in flight")):
        fig, ax = plt.subplots(figsize=(10, 5))
        for system, points in sweeps.items():
            pts = [(p["size"], p[key]) for p in points if p.get(key)]
            if not pts:
                continue
            mean = any(p.get("p50_is_mean") for p in points) and key == "p50_us"
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3,
                    label=system + (" (mean)" if mean else ""), color=colour(system))
        _size_axis(ax, sorted({p["size"] for pts in sweeps.values() for p in pts}))
        ax.set_yscale("log")
        ax.set_xlabel("message size (log)")
        ax.set_ylabel(ylabel)
        ax.set_title(title + "\n" + _subtitle(report), fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        paths += _save(fig, out_dir, name)
    return paths


def bulk_plot(plt, report, out_dir):
    bulk = report.get("sweeps", {}).get("bulk", {})
    if not bulk:
        return []
    fig, axes = plt.subplots(1, len(bulk), figsize=(10, 4.2), squeeze=False)
    styles = {"window + SEND_WITH_INV": ("#2ca02c", "-"), "window + LOCAL_INV fallback": ("#ff7f0e", "--"),
              "client's window (mirror) + SEND_WITH_INV": ("#1f77b4", ":")}
    for ax, (test, modes) in zip(axes[0], sorted(bulk.items())):
        for mode, points in modes.items():
            pts = [(p["size"], p["gbytes_per_s"]) for p in points if p.get("gbytes_per_s")]
            c, ls = styles.get(mode, (None, "-"))
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3, label=mode,
                    color=c, linestyle=ls)
        _size_axis(ax, sorted({p["size"] for pts in modes.values() for p in pts}))
        ax.set_xlabel("transfer size (log)")
        ax.set_ylabel("GB/s (8 in flight)")
        ax.set_title({"bulk_read": "downloads (bulk_read)", "bulk_write": "uploads (bulk_write)"}.get(test, test))
        ax.legend(fontsize=7)
    fig.suptitle("swirl bulk transfers by invalidation mode\n" + _subtitle(report), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return _save(fig, out_dir, "bulk_modes")


def render(report, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    plt = _pyplot()
    paths = latency_cdf(plt, report, out_dir)
    paths += size_plots(plt, report, out_dir)
    paths += bulk_plot(plt, report, out_dir)
    plt.close("all")
    return paths


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: bench_plots.py REPORT.json OUT_DIR")
    with open(sys.argv[1]) as f:
        report = json.load(f)
    for p in render(report, sys.argv[2]):
        print(p)


if __name__ == "__main__":
    main()
