"""Compiler flags for swirl's own code (third-party and generated code get the defaults)."""

SWIRL_COPTS = [
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-missing-field-initializers",
]

# Generated protobuf/gRPC sources are not ours to keep warning-free.
GENERATED_COPTS = ["-Wno-unused-parameter"]
