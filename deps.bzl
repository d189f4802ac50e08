"""Repositories swirl needs, all local. An embedding workspace calls this too.

Usage from another workspace:

    local_repository(name = "swirl", path = "/path/to/swirl")
    load("@swirl//:deps.bzl", "swirl_dependencies")
    swirl_dependencies(swirl_path = "/path/to/swirl")
"""

def swirl_dependencies(swirl_path = "."):
    """Declares the offline stand-ins and the system library repository.

    Args:
      swirl_path: where the swirl checkout lives, relative to the calling workspace's root or
        absolute. "." when swirl is the main workspace.
    """

    # Bazel 4.2.3's built-in WORKSPACE suffix asks for these by download; declaring them first,
    # as local repositories that forward to the native rules, keeps every build offline.
    native.local_repository(
        name = "rules_cc",
        path = swirl_path + "/third_party/rules_cc",
    )
    native.local_repository(
        name = "rules_java",
        path = swirl_path + "/third_party/rules_java",
    )
    native.local_repository(
        name = "remote_coverage_tools",
        path = swirl_path + "/third_party/remote_coverage_tools",
    )

    # rdma-core, Abseil, Protocol Buffers, gRPC, googletest and Google Benchmark from Debian's
    # -dev packages. Headers are found on the compiler's system include path (/usr/include).
    native.new_local_repository(
        name = "system",
        path = "/usr",
        build_file = "@swirl//third_party:system.BUILD",
    )
