"""The two-host Ray cluster the multihost tests build (it lives in the package, where
``weightsync bench --transports ray-delta`` builds it too)."""

from weightsync.bench.multihost import (  # noqa: F401
    ADDRESS_A,
    ADDRESS_B,
    TwoHostCluster,
    two_host_cluster,
    unavailable_reason,
)


def cluster_for_module(tests_dir: str):  # type: ignore[no-untyped-def]
    """The body of a module-scoped ``cluster`` fixture: skip where namespaces are not
    available, start from no Ray instance, build the cluster, and check that nothing is
    left behind once the module is done."""
    import pytest
    import ray

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"two-host cluster unavailable: {reason}")
    if ray.is_initialized():
        ray.shutdown()  # a Ray instance left by another module: this one needs its own
    with two_host_cluster(tests_dir) as made:
        yield made
    assert made.leftovers() == [], made.leftovers()
