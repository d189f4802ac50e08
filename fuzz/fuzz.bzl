"""swirl_fuzzer: one libFuzzer target, and its corpus replayed in the ordinary build.

For a fuzzer NAME with source NAME.cc (which defines LLVMFuzzerTestOneInput, and may define
LLVMFuzzerInitialize), this makes:

  NAME       the fuzzing binary. Under --config=fuzz (clang-16, -fsanitize=fuzzer,address,
             undefined: .bazelrc) it is a libFuzzer binary; built any other way, the replay tool
             below with the same command line for files and directories. Tagged manual, so that
             //... never builds it: ./swirl fuzz and tools/fuzz_check.sh build it with
             --config=fuzz.
  NAME_test  a cc_test in the ordinary (GCC) build, in every `./swirl test`: the same input
             function over every file of corpus/NAME (the committed seeds) and regressions/NAME
             (inputs that once crashed it), one gtest case per file (replay_main.cc).

Why both: `./swirl test` runs the whole suite in one GCC configuration, and a clang-built binary
cannot be one of its tests without building everything twice in that invocation. So the suite
keeps what can be checked deterministically, every committed input replayed, in GCC; the coverage-
guided search runs in a second Bazel invocation with --config=fuzz after the suite
(tools/fuzz_check.sh, a few seconds per target), whose result lines the summary counts.
"""

load("//tools:copts.bzl", "SWIRL_COPTS")

def swirl_fuzzer(name, deps, env = {}, exclusive = False):
    native.cc_binary(
        name = name,
        testonly = True,
        srcs = [name + ".cc"],
        copts = SWIRL_COPTS,
        linkopts = select({
            "//fuzz:fuzzing": ["-fsanitize=fuzzer"],
            "//conditions:default": [],
        }),
        # Not built by //...: the libFuzzer binary needs --config=fuzz (clang-16). It is not
        # skipped: tools/fuzz_check.sh builds and runs it in ./swirl test, and the cc_test
        # below replays its corpus with GCC in //....
        tags = ["manual"],
        deps = deps + ["//fuzz:fuzz_support"] + select({
            "//fuzz:fuzzing": [],
            "//conditions:default": ["//fuzz:replay_main"],
        }),
    )
    inputs = native.glob(["corpus/%s/*" % name, "regressions/%s/*" % name])
    native.cc_test(
        name = name + "_test",
        srcs = [name + ".cc"],
        args = ["$(rootpath %s)" % f for f in inputs],
        copts = SWIRL_COPTS,
        data = inputs,
        env = env,
        tags = ["exclusive"] if exclusive else [],
        deps = deps + ["//fuzz:fuzz_support", "//fuzz:replay_main"],
    )
