#!/usr/bin/env bash
# Embedding check: swirl used from outside its own workspace, the two supported ways.
#
#   embedding:make   `./swirl install --prefix TMP`; the installed headers are exactly the public
#                    ones (rpc/public_headers.bzl, under include/swirl/) and each compiles
#                    alone with only pkg-config's flags; the installed libswirl_soft_verbs.so
#                    gives ibv_devices soft0; then a copy of examples/embed_make built with its
#                    Makefile against TMP (pkg-config, protoc + the installed plugin) and run,
#                    linked with libswirl.a (make run) and with libswirl.so (make run-shared)
#   embedding:bazel  examples/embed_bazel, a separate Bazel workspace that has swirl as
#                    local_repository @swirl, built (bazel build //...) and run
#
# Usage: tools/embedding_check.sh [--results FILE]
#
# `./swirl test` runs this after the Bazel suite (it runs make and a second Bazel workspace, which
# do not belong inside Bazel's sandbox) and counts each line it appends to FILE, "PASSED name" or
# "FAILED name", in the final "N passed, N failed" line. Exits 1 if either failed.
#
# Offline: the nested workspace's .bazelrc and the flags below forbid downloads, and every
# repository it uses is local (deps.bzl). It shares the main workspace's output_user_root, so it
# reuses the installed Bazel; its own output base keeps its build cached between runs, and its
# server is shut down afterwards.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

results=""
while [ $# -gt 0 ]; do
  case "$1" in
    --results) results="${2:?--results needs a file}"; shift 2 ;;
    *) echo "usage: tools/embedding_check.sh [--results FILE]" >&2; exit 2 ;;
  esac
done

work="$(mktemp -d "${TMPDIR:-/tmp}/swirl-embedding.XXXXXX")"
trap 'rm -rf "$work"' EXIT
failed=0

record() {  # record NAME RC LOG
  local name="$1" rc="$2" log="$3" status=PASSED
  if [ "$rc" -eq 0 ]; then
    echo "$name: PASSED"
    grep -h -e '^embed_[a-z]*: ' -e '^\./counter' -e 'installed headers' -e 'compiles alone' \
      -e 'libswirl_soft_verbs' "$log" |
      sed 's/^/  /'
  else
    status=FAILED
    failed=1
    echo "$name: FAILED (exit $rc); the end of its log:"
    grep -v 'src/main/tools/linux-sandbox' "$log" | tail -n 40 | sed 's/^/  | /'
  fi
  if [ -n "$results" ]; then echo "$status $name" >>"$results"; fi
}

echo "embedding check: ./swirl install + examples/embed_make, examples/embed_bazel"

# (a) install, then the Makefile example against the installed copy.
(
  set -e
  ./swirl install --prefix "$work/prefix"
  # Only the public API is installed: include/swirl/ holds exactly rpc/public_headers.bzl's
  # list, and nothing else is there but the generated option header and its .proto (no base/,
  # transport/, no internal rpc header such as worker.h or wire.h).
  expected="$(sed -n 's/^ *"\([a-z_]*\.h\)",$/swirl\/\1/p' rpc/public_headers.bzl | sort)"
  [ -n "$expected" ] || { echo "no public headers listed in rpc/public_headers.bzl" >&2; exit 1; }
  installed="$(cd "$work/prefix/include" && find . -type f | sed 's|^\./||' | sort)"
  unexpected="$(comm -13 <(printf '%s\nproto/options.pb.h\nproto/options.proto\n' "$expected" | sort) \
    <(echo "$installed"))"
  missing="$(comm -23 <(echo "$expected") <(echo "$installed"))"
  if [ -n "$unexpected" ] || [ -n "$missing" ]; then
    echo "installed headers differ from the public API:" >&2
    [ -z "$unexpected" ] || echo "  not public, installed:$(printf ' %s' $unexpected)" >&2
    [ -z "$missing" ] || echo "  public, not installed:$(printf ' %s' $missing)" >&2
    exit 1
  fi
  echo "installed headers: the $(echo "$expected" | wc -l) public ones under swirl/, no internal header"
  # Each public header compiles alone (a translation unit that includes just it) against the
  # installed tree with pkg-config's flags only: none leans on another's includes.
  cflags="$(PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig" pkg-config --cflags swirl)"
  for h in $expected; do
    printf '#include "%s"\n' "$h" >"$work/alone.cc"
    g++ -std=c++20 -fsyntax-only $cflags "$work/alone.cc" ||
      { echo "$h does not compile on its own" >&2; exit 1; }
  done
  echo "each of the $(echo "$expected" | wc -l) public headers compiles alone"
  # The installed interposer gives an unmodified verbs program soft0.
  LD_PRELOAD="$work/prefix/lib/libswirl_soft_verbs.so" ibv_devices | grep -q '^ *soft0 ' ||
    { echo "the installed libswirl_soft_verbs.so does not give ibv_devices soft0" >&2; exit 1; }
  echo "installed libswirl_soft_verbs.so: ibv_devices lists soft0"
  cp -R examples/embed_make "$work/embed_make"
  make -s -C "$work/embed_make" clean
  timeout 600 make -C "$work/embed_make" SWIRL_PREFIX="$work/prefix" run run-shared
) >"$work/make.log" 2>&1
record embedding:make $? "$work/make.log"

# (b) the separate Bazel workspace.
(
  set -e
  output_base="$(bazel info output_base 2>/dev/null)"  # the main workspace's
  [ -n "$output_base" ] || { echo "bazel info output_base failed in $ROOT" >&2; exit 1; }
  cd examples/embed_bazel
  nested=(bazel "--output_user_root=$(dirname "$output_base")")
  # Belt and braces: no downloads (also in its .bazelrc), and for Bazel (only: gRPC in the
  # example would use it too) a proxy that refuses everything, should anything try anyway.
  # --symlink_prefix=/: no bazel-* symlinks in the source tree from the check itself.
  offline=(--repository_cache= --experimental_repository_disable_download --symlink_prefix=/)
  no_net=(env HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9
          http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9)
  rc=0
  timeout 900 "${no_net[@]}" "${nested[@]}" build "${offline[@]}" //... || rc=$?
  if [ $rc -eq 0 ]; then
    bin="$("${nested[@]}" info "${offline[@]}" bazel-bin 2>/dev/null)"
    timeout 120 "$bin/greeter" || rc=$?
  fi
  "${nested[@]}" shutdown || true
  exit $rc
) >"$work/bazel.log" 2>&1
record embedding:bazel $? "$work/bazel.log"

exit $failed
