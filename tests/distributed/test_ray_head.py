"""rlhfkit.distributed.ray_head: the local cluster a run starts has no autoscaler monitor and leaves the dashboard's
optional dependencies out of the driver; Ray's internals are restored afterwards, and a Ray without them is left
alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from ray._private import parameter
from ray._private import utils as ray_utils

from rlhfkit.distributed.ray_head import MINIMAL, lean_local_head

ROOT = Path(__file__).resolve().parents[2]


def test_within_the_block_a_head_has_no_monitor_and_counts_the_dashboard_deps_absent() -> None:
    init, deps = parameter.RayParams.__init__, ray_utils.get_dashboard_dependency_error
    with lean_local_head() as lean:
        assert lean is True
        assert parameter.RayParams(num_cpus=1).no_monitor is True
        assert ray_utils.get_dashboard_dependency_error() is MINIMAL
    assert parameter.RayParams.__init__ is init and ray_utils.get_dashboard_dependency_error is deps
    assert parameter.RayParams(num_cpus=1).no_monitor is False


def test_log_monitor_is_left_out_only_when_asked() -> None:
    with lean_local_head():
        assert parameter.RayParams(num_cpus=1).include_log_monitor is None  # Ray's default: started
    with lean_local_head(log_monitor=False) as lean:
        assert lean is True
        params = parameter.RayParams(num_cpus=1, include_log_monitor=True)  # what ray.init passes is overridden
        assert params.include_log_monitor is False and params.no_monitor is True
    assert parameter.RayParams(num_cpus=1).include_log_monitor is None


def test_internals_are_restored_when_ray_init_fails() -> None:
    init = parameter.RayParams.__init__
    with pytest.raises(RuntimeError), lean_local_head():
        raise RuntimeError("ray.init failed")
    assert parameter.RayParams.__init__ is init


def test_a_ray_without_the_field_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    def other_init(self, num_cpus=None):  # a future RayParams without no_monitor
        self.num_cpus = num_cpus

    monkeypatch.setattr(parameter.RayParams, "__init__", other_init)
    deps = ray_utils.get_dashboard_dependency_error
    with lean_local_head() as lean:
        assert lean is False
        assert parameter.RayParams.__init__ is other_init and ray_utils.get_dashboard_dependency_error is deps


RUN = """
    import json, os, sys
    import psutil, ray
    from rlhfkit.distributed.placement import connect_ray

    assert connect_ray(2)

    @ray.remote
    def pid():
        return os.getpid()

    worker = ray.get(pid.remote())
    me = psutil.Process()
    commands = [" ".join(p.cmdline()) for p in me.children(recursive=True)]
    imported = sorted(m for m in ("aiohttp", "opentelemetry", "prometheus_client") if m in sys.modules)
    ray.shutdown()
    print(json.dumps({"worker": worker != os.getpid(), "commands": commands, "imported": imported,
                      "left": [p.pid for p in me.children(recursive=True) if p.status() != "zombie"]}))
"""


@pytest.mark.slow
def test_a_run_cluster_starts_without_monitor_and_stops_cleanly() -> None:
    """A real `connect_ray` in a fresh driver: tasks run, Ray's other processes are there, the monitor is not, the
    driver never imported the dashboard's optional dependencies, and shutdown leaves no process behind."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(ROOT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(RUN)], env=env, capture_output=True, text=True,
                         timeout=180, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    commands = "\n".join(r["commands"])
    assert r["worker"] and "gcs_server" in commands and "raylet" in commands and "log_monitor.py" in commands
    assert "autoscaler/_private/monitor.py" not in commands
    assert r["imported"] == [] and r["left"] == []
