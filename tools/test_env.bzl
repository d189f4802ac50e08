"""Environments for swirl's test targets."""

# Tests of the RPC layer, the examples and the benchmarks open the default device. They are
# soft-device tests (their expectations, skips and the TCP variants are written for soft0), so
# they name it: on a host with a NIC they would otherwise run half on hardware while claiming a
# soft device. The servers they start inherit it. The conformance suite and
# rdma_core_device_test choose their devices themselves (SWIRL_CONFORMANCE_DEVICES).
SOFT0_TEST_ENV = {"SWIRL_DEVICE": "soft0"}

def soft0_test_env(extra = {}):
    """SOFT0_TEST_ENV with `extra` (e.g. SWIRL_SOFT_TCP for a TCP-fabric variant)."""
    env = dict(SOFT0_TEST_ENV)
    env.update(extra)
    return env

# The interposer that makes soft0 an rdma-core device (docs/SOFT_VERBS.md), for *_rdma_core
# test variants: put SOFT_VERBS in the target's data.
SOFT_VERBS = "//transport/soft_verbs:libswirl_soft_verbs.so"

# A test variant that runs the code path a NIC user's process takes (RdmaCoreDevice,
# libibverbs' exports, ibv_get_device_list) on soft0, through the interposer. The servers and
# peers the test starts inherit both variables.
RDMA_CORE_SOFT0_TEST_ENV = {
    "LD_PRELOAD": "$(rootpath %s)" % SOFT_VERBS,
    "SWIRL_DEVICE": "rdma-core:soft0",
}
