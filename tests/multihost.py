"""The two-host Ray cluster the multihost tests build (it lives in the package, where
``weightsync bench --transports ray-delta`` builds it too)."""

from weightsync.bench.multihost import (  # noqa: F401
    ADDRESS_A,
    ADDRESS_B,
    TwoHostCluster,
    two_host_cluster,
    unavailable_reason,
)
