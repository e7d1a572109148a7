"""One local Ray cluster per test process (loopback only), shared by tests/distributed and tests/rollout."""

from __future__ import annotations

import os

from rlhfkit.distributed.ray_head import lean_local_head

NUM_CPUS = 8  # logical CPUs: placement bundles are bookkeeping here, the machine has 2 cores


def ensure_ray() -> None:
    """Start the session's Ray cluster once; later calls reuse it (Ray shuts down at interpreter exit)."""
    import ray

    if ray.is_initialized():
        return
    for key, value in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                       "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}.items():
        os.environ.setdefault(key, value)
    os.environ.pop("RAY_ADDRESS", None)
    # as a run starts its own cluster (no autoscaler monitor), and no log monitor: nothing here reads the workers'
    # output from the driver (log_to_driver=False; rlhfkit/distributed/ray_head.py)
    with lean_local_head(log_monitor=False):
        ray.init(address="local", num_cpus=NUM_CPUS, num_gpus=0, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", configure_logging=True)
