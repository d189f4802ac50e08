#!/usr/bin/env python3
"""Turns a real Bazel run into a fixture for tools/test_summary_test.py.

  bazel test --keep_going --build_event_json_file=/tmp/bep.json ... > /tmp/console.log 2>&1
  tools/testdata/test_summary/capture.py /tmp/bep.json /tmp/console.log "$(bazel info bazel-testlogs)" DIR

keeps the events test_summary.py reads (trimmed of command lines and output lists), rewrites
the testlogs paths to @TESTLOGS@, and copies every test.xml the events name into DIR/testlogs,
plus any extra testlogs-relative paths given after DIR (a stale test.xml, say).
"""
import json
import os
import shutil
import sys

KEEP = ("started", "targetConfigured", "targetCompleted", "testResult", "testSummary",
        "buildFinished")


def main(bep, console, testlogs, out_dir, *extra):
    real = os.path.realpath(testlogs)
    os.makedirs(out_dir, exist_ok=True)
    lines = []
    copies = list(extra)
    for line in open(bep):
        e = json.loads(line)
        kind = next(iter(e["id"]))
        if kind not in KEEP and "aborted" not in e:
            continue
        if kind == "started":
            e = {"id": e["id"], "started": {"startTimeMillis": e["started"]["startTimeMillis"],
                                            "command": e["started"].get("command", "")}}
        e.pop("children", None)
        for key in ("importantOutput", "outputGroup"):
            e.get("completed", {}).pop(key, None)
        for key in ("passed", "failed"):
            e.get("testSummary", {}).pop(key, None)
        if kind == "testResult":
            outs = e["testResult"].get("testActionOutput", [])
            e["testResult"]["testActionOutput"] = [o for o in outs if o["name"] == "test.xml"]
        text = json.dumps(e, sort_keys=True)
        for prefix in (real, testlogs):
            text = text.replace("file://" + prefix, "file://@TESTLOGS@")
        lines.append(text)
        for o in json.loads(text).get("testResult", {}).get("testActionOutput", []):
            copies.append(o["uri"][len("file://@TESTLOGS@/"):])
    for rel in copies:
        dest = os.path.join(out_dir, "testlogs", rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy(os.path.join(real, rel), dest)
    with open(os.path.join(out_dir, "bep.json"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(console, errors="replace") as f, open(os.path.join(out_dir, "console.log"), "w") as o:
        o.writelines(l for l in f if l.startswith(("ERROR: ", "FAILED", "//")))


if __name__ == "__main__":
    main(*sys.argv[1:])
