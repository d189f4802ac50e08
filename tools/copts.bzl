"""Compiler flags for swirl's own code (third-party and generated code get the defaults)."""

SWIRL_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-missing-field-initializers",
] + select({
    # Optimized builds of swirl's own code use -O3: GCC 12 at -O2 leaves the small helpers of
    # the per-message paths (completion push, one-SGE copy, header checks) out of line, and
    # -O3's inlining takes 8% of the soft device's instructions per round trip
    # (docs/BENCHMARKS.md). Sanitizer and debug builds keep their own levels.
    "//tools:opt": ["-O3"],
    "//conditions:default": [],
})

# Generated protobuf/gRPC sources are not ours to keep warning-free.
GENERATED_COPTS = ["-Wno-unused-parameter"]
