"""The one-node Ray cluster a run starts for itself, without the two parts of a Ray head it cannot use.

When no cluster is named (`RAY_ADDRESS` unset), `connect_ray` starts a Ray head inside the driver with
`ray.init(address="local")`, for this run only. Ray then also starts, whatever `include_dashboard` says:
- the autoscaler monitor (`monitor.py`), a Python process that adds and removes nodes. A cluster of this one machine
  has none to add; Ray's own `ray start --head --no-monitor` skips it, and `ray.init` has no such argument.
- the dashboard's optional dependencies (aiohttp, OpenTelemetry, Prometheus, gRPC...), imported into the driver only
  to decide whether the full dashboard could start; it does not start (`include_dashboard=False`), and the dashboard
  head and agent then run as with `pip install ray` without `[default]` ("minimal").
Measured on the 2-core CI machine (Ray 2.60, the tiny `train_ppo_ray` run): the monitor holds 51 MB of PSS and
the optional dependencies 15-22 MB in the driver, about 5% of the run's process tree.

`lean_local_head()` wraps that `ray.init` and sets both through the two Ray internals that decide them, for the
duration of the call: `RayParams.no_monitor` (the `--no-monitor` flag's field) and
`ray._private.utils.get_dashboard_dependency_error`. Where a Ray release moved either, nothing is changed and Ray
starts its usual head. A cluster started with `ray start` (named by `RAY_ADDRESS`, multi-node runs, `ray job
submit`) is never touched: it keeps its monitor, its autoscaler and its dashboard.

`lean_local_head(log_monitor=False)` also leaves out the log monitor (`RayParams.include_log_monitor`), the process
that tails every worker's log files and forwards new lines to drivers started with `log_to_driver=True` (a run's
driver is, so that its roles' output reaches the terminal). A driver started with `log_to_driver=False` never reads
them: the test suite's shared cluster, where the monitor polled the logs of a few hundred workers for about 65 CPU
seconds of a 40-minute run (measured 2026-11-29, Ray 2.60).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: Why the dashboard's optional dependencies count as absent while rlhfkit starts its own head.
MINIMAL = ImportError("rlhfkit's one-run local cluster: no dashboard (include_dashboard=False)")


@contextmanager
def lean_local_head(log_monitor: bool = True) -> Iterator[bool]:
    """Within it, a `ray.init` that starts a local head starts it without the autoscaler monitor (and without the
    log monitor when `log_monitor` is False: only for `log_to_driver=False`) and without importing the dashboard's
    optional dependencies; yields whether Ray's internals allowed it."""
    try:
        from ray._private import parameter
        from ray._private import utils as ray_utils

        original_init: Any = parameter.RayParams.__init__
        original_deps: Any = ray_utils.get_dashboard_dependency_error
        fields = original_init.__code__.co_varnames
        if "no_monitor" not in fields or (not log_monitor and "include_log_monitor" not in fields):
            raise AttributeError("RayParams has no no_monitor (or no include_log_monitor)")
    except (ImportError, AttributeError):
        yield False
        return

    left_out: dict[str, bool] = {"no_monitor": True} if log_monitor else \
        {"no_monitor": True, "include_log_monitor": False}

    def init_without_monitor(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **{**kwargs, **left_out})

    parameter.RayParams.__init__ = init_without_monitor  # type: ignore[method-assign]
    ray_utils.get_dashboard_dependency_error = lambda: MINIMAL
    try:
        yield True
    finally:
        parameter.RayParams.__init__ = original_init  # type: ignore[method-assign]
        ray_utils.get_dashboard_dependency_error = original_deps
