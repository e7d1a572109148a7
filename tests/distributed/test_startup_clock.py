"""The start-up timeline's arithmetic (no Ray): milestones of a process become the seconds between them."""

from __future__ import annotations

from rlhfkit.distributed.startup_clock import StartupClock, intervals


def test_milestones_become_seconds_since_the_previous_one_the_first_since_launch():
    got = intervals(100.0, {"started": 103.0, "process_group": 110.5, "role_built": 111.0}, "actor")
    assert got == {"actor_started_s": 3.0, "actor_process_group_s": 7.5, "actor_role_built_s": 0.5}


def test_clock_laps_and_actor_marks_land_in_one_metrics_dict():
    clock = StartupClock()
    clock.started = clock.last = 50.0
    clock.launches["engine"] = 52.0
    clock.add_actor_marks("engine", {"started": 53.0, "llm_built": 60.0})
    clock.phases["ray_init_s"] = 4.0
    clock.last = 70.0
    metrics = clock.metrics()
    assert metrics == {"engine_started_s": 1.0, "engine_llm_built_s": 7.0, "ray_init_s": 4.0, "total_s": 20.0}
    assert clock.line().startswith("start-up (s): engine_started 1.0")
