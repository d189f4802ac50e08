"""cc_test_variants: one test's sources run as several test targets, compiled once."""

def cc_test_variants(name, srcs, variants, deps = [], copts = [], data = [], **kwargs):
    """A cc_test `name + suffix` for each (suffix, env, data) of `variants`, on the same cases.

    The sources compile once, into the testonly cc_library `name + "_cases"`, which every
    variant links; a cc_test per variant with the sources in its own `srcs` compiled them once
    per variant (the conformance suite's three variants, the RPC tests' two or three), the same
    objects two or three times over in every configuration that builds them (the suite's, ASan,
    TSan). alwayslink: the gtest cases register from static initializers that nothing else
    references, which the linker would otherwise drop from a static link.

    Args:
      name: the first variant's name without its suffix; also the prefix of the cases library.
      srcs: the test's sources.
      variants: a list of (suffix, env, extra data) for each test target.
      deps: the test's dependencies (gtest_main among them).
      copts: compile options of the sources.
      data: data every variant needs; each variant adds its own extra data.
      **kwargs: the rest of each cc_test's attributes (size, tags, ...).
    """
    native.cc_library(
        name = name + "_cases",
        testonly = True,
        srcs = srcs,
        copts = copts,
        deps = deps,
        alwayslink = True,
    )
    for suffix, env, extra_data in variants:
        native.cc_test(
            name = name + suffix,
            env = env,
            data = data + extra_data,
            deps = [":" + name + "_cases"],
            **kwargs
        )
