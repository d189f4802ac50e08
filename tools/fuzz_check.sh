#!/usr/bin/env bash
# Fuzz check: every libFuzzer target in fuzz/ (fuzz/BUILD), fuzzed for a few seconds each.
#
#   fuzz:NAME   NAME built with --config=fuzz (clang-16, -fsanitize=fuzzer,address,undefined:
#               .bazelrc, fuzz/toolchain), then run over its committed seeds
#               (fuzz/corpus/NAME) and crash reproducers (fuzz/regressions/NAME), and on for
#               SECONDS of coverage-guided search from there. PASSED if nothing crashed, hung
#               (10 s for one input) or broke a property; FAILED otherwise, with the input kept.
#
# Usage: tools/fuzz_check.sh [--results FILE] [--seconds N] [NAME...]
#
# `./swirl test` runs this after the Bazel suite (the suite builds everything with GCC in one
# invocation; a clang build is a second one, so it happens here, as the embedding check's
# second workspace does) and counts each line it appends to FILE, "PASSED fuzz:NAME" or
# "FAILED fuzz:NAME", in the final "N passed, N failed" line. The ordinary suite replays the
# same corpora without clang (//fuzz:NAME_test). Seconds per target: --seconds, else
# SWIRL_FUZZ_SECONDS, else 10, so the five targets fuzz for under a minute together; what
# fuzzing adds to the corpus is thrown away (./swirl fuzz NAME SECONDS keeps it, for longer
# runs). Exits 1 if any target failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

results=""
seconds="${SWIRL_FUZZ_SECONDS:-10}"
names=()
while [ $# -gt 0 ]; do
  case "$1" in
    --results) results="${2:?--results needs a file}"; shift 2 ;;
    --seconds) seconds="${2:?--seconds needs a number}"; shift 2 ;;
    -*) echo "usage: tools/fuzz_check.sh [--results FILE] [--seconds N] [NAME...]" >&2; exit 2 ;;
    *) names+=("$1"); shift ;;
  esac
done
if [ ${#names[@]} -eq 0 ]; then
  mapfile -t names < <(sed -n 's/^ *name = "\([a-z_]*_fuzzer\)",$/\1/p' fuzz/BUILD)
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/swirl-fuzz.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# Crash reproducers outlive the run: they are what a regression test is made from.
crashes="${TMPDIR:-/tmp}/swirl-fuzz-crashes"

record() {  # record NAME STATUS
  if [ -n "$results" ]; then echo "$2 fuzz:$1" >>"$results"; fi
}

echo "fuzz check: ${names[*]} (${seconds} s each, clang-16, --config=fuzz)"
targets=()
for name in "${names[@]}"; do targets+=("//fuzz:$name"); done
if ! bazel build --config=fuzz --noshow_progress --ui_event_filters=-info,-stdout,-stderr \
    --show_result=0 "${targets[@]}" >"$work/build.log" 2>&1; then
  echo "fuzz check: the --config=fuzz build failed; the end of its log:"
  grep -v 'src/main/tools/linux-sandbox' "$work/build.log" | tail -n 40 | sed 's/^/  | /'
  for name in "${names[@]}"; do record "$name" FAILED; done
  exit 1
fi
bin="$(bazel info --config=fuzz bazel-bin 2>/dev/null)/fuzz"

failed=0
for name in "${names[@]}"; do
  mkdir -p "$work/$name/corpus" "$work/$name/artifacts"
  inputs=(fuzz/corpus/"$name")
  [ -d fuzz/regressions/"$name" ] && inputs+=(fuzz/regressions/"$name")
  # -timeout: one input that takes this long hangs (the targets' own waits end within 3 s).
  # -len_control=0: inputs up to -max_len from the start, which a run this short needs.
  rc=0
  "$bin/$name" -max_total_time="$seconds" -timeout=10 -max_len=2048 -len_control=0 \
    -print_final_stats=1 -artifact_prefix="$work/$name/artifacts/" \
    "$work/$name/corpus" "${inputs[@]}" >"$work/$name.log" 2>&1 || rc=$?
  runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$name.log")"
  cov="$(grep -o 'cov: [0-9]*' "$work/$name.log" | tail -n 1 | cut -d' ' -f2)"
  found="$(find "$work/$name/artifacts" -type f | head -n 1)"
  if [ $rc -eq 0 ] && [ -z "$found" ]; then
    echo "fuzz:$name: PASSED (${runs:-?} runs in ${seconds} s, ${cov:-?} edges covered)"
    record "$name" PASSED
  else
    failed=1
    echo "fuzz:$name: FAILED (exit $rc); the end of its log:"
    grep -v '^[WE][0-9]' "$work/$name.log" | tail -n 40 | sed 's/^/  | /'
    if [ -n "$found" ]; then
      mkdir -p "$crashes/$name"
      cp "$work/$name/artifacts/"* "$crashes/$name/"
      echo "  the input: $crashes/$name/$(basename "$found") (replay: $bin/$name FILE; make it a"
      echo "  regression: copy it into fuzz/regressions/$name/ and fix what it breaks)"
    fi
    record "$name" FAILED
  fi
done
exit $failed
