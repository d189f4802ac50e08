"""Compiler flags for swirl's own code (third-party and generated code get the defaults)."""

SWIRL_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-missing-field-initializers",
] + select({
    # Optimized builds of swirl's own code use -O3: GCC 12 at -O2 leaves small helpers of the
    # per-message paths out of line; -O3 took the soft device's own instructions per message
    # down 5% (soft_path_bench --count, docs/BENCHMARKS.md). Sanitizer and debug builds keep
    # their own levels.
    "//tools:opt": ["-O3"],
    "//conditions:default": [],
})

# Generated protobuf/gRPC sources are not ours to keep warning-free.
GENERATED_COPTS = ["-Wno-unused-parameter"]
