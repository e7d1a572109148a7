"""Which tests `make test-fast` leaves out (the `slow` mark) and which tests `make test`'s two pytest-xdist workers
must run in one worker (the `xdist_group` mark); applied at collection by tests/conftest.py. tests/README.md
states the rules.

slow: a test that starts Ray, trains or generates through a CLI or a subprocess, or builds a session fixture that
does (an SFT run, a reward model). `make test-fast` (`-m "not slow"`) keeps the unit tests, a few minutes in all.

xdist_group: `make test` runs `-n 2 --dist loadgroup`, and every test is in one group, so a group runs whole in one
worker, in collection order. By default the group is the test's module: its module-scoped fixtures (trained models,
servers, engines) are built once, and its tests run in the order and process they always did. A test whose state
stays in its own process and tmp_path is safe beside any other: environment and cwd changes (monkeypatch,
`world_of_one`), in-process process groups (a world of one on a free port), subprocesses and servers on free ports.
Tests that must not run side by side share a group across modules:
- "ray": every test that starts a Ray cluster, in this process (`tests/distributed/ray_cluster.py`, started once
  per worker) or in a child (`train_ppo_ray`, `ray start`). One worker holds them: the in-process cluster starts
  once (6-8 s, 0.5 GB) instead of once per worker, two Ray process trees (3-5 GB each with vLLM engines) never
  share the two cores and the memory, and the failure tests' stop-within-seconds bounds keep their margin.
- "sft_model": the tests of the session fixture `sft_model_dir` (500 SFT steps, minutes): a session fixture is
  built once per worker, so its users share one worker to build it once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Test modules (paths under tests/, "run/test_loop.py") whose every test is slow, and single slow tests
# ("module::function", every parametrization). Other tests are slow through SLOW_FIXTURES.
SLOW = {
    "agents/test_openai_endpoint.py::test_one_rl_step_trains_on_http_driven_episodes",
    "bench/test_gpu_suite.py",
    "bench/test_grpo_ray_bench.py",
    "cli/test_bad_inputs.py::test_invalid_negative_learning_rate_exits_2_in_a_real_process",
    "cli/test_bad_inputs.py::test_malformed_data_line_exits_2_in_a_real_process",
    "cli/test_batch_inference.py",
    "cli/test_demo.py",
    "cli/test_interactive_chat.py",
    "cli/test_preference_cli.py",
    "cli/test_seed_commands.py::test_scaling_keeps_every_seed_flag",
    "cli/test_seed_commands.py::test_seed_block_runs",
    "cli/test_train_ppo_ray.py::test_cli_process_exits_2_without_starting_ray",
    "cli/test_train_ppo_ray.py::test_ray_job_submit_runs_group_norm_on_the_transformers_engine",
    "cli/test_train_ppo_ray_failures.py",
    "cli/test_train_sft.py",
    "distributed/test_launch.py",
    "distributed/test_ray_agents.py",
    "distributed/test_ray_async.py",
    "distributed/test_ray_groups.py",
    "distributed/test_ray_ppo.py",
    "docs/test_docs_site.py",
    "examples/test_dapo_recipe.py",
    "examples/test_iterative_dpo.py",
    "logging/test_html_report.py",
    "logging/test_tensorboard.py",
    "planner/test_plan_measured.py",
    "rewards/test_server.py::test_bad_port_fails_before_the_model_loads",
    "rewards/test_server.py::test_cli_bad_model_path_is_one_line_exit_2",
    "rewards/test_server.py::test_cli_prints_its_url_and_serves",
    "rl/test_rl_bad_rewards.py",
    "rl/test_rl_estimators.py",
    "rl/test_rl_learning.py",
    "rl/test_rl_recipes.py",
    "rollout/test_vllm_engine.py",
    "run/test_checkpoint.py::test_universal_checkpoint_resumes_exactly_at_another_zero_stage_and_world_size",
    "run/test_kill_safety.py",
    "run/test_loop.py::test_nonfinite_sft_run_skips_counts_and_stops_with_its_checkpoints_intact",
    "run/test_preemption.py",
    "trainers/test_dpo.py",
    "trainers/test_kto.py",
    "trainers/test_reward.py",
    "trainers/test_sft.py",
}
# Session fixtures that train a model or start Ray: a test that uses one is slow.
SLOW_FIXTURES = {"ray_cluster", "sft_model_dir"}

# Modules and tests (as in SLOW) that start a Ray cluster, in this process or in a child, without the `ray_cluster`
# fixture. A whole module is named where its module-scoped fixtures serve its Ray tests too.
RAY = {
    "bench/test_grpo_ray_bench.py",
    "cli/test_batch_inference.py",
    "cli/test_demo.py",
    "cli/test_seed_commands.py",
    "cli/test_train_ppo_ray.py",
    "cli/test_train_ppo_ray_failures.py",
    "examples/test_dapo_recipe.py",
    "rollout/test_vllm_engine.py",
    "run/test_kill_safety.py::test_ppo_ray_driver_sigkill_leaks_no_actors_and_resumes_to_the_same_weights",
}


def module_of(item: pytest.Item) -> str:
    """The test's file as a path under tests/ ("cli/test_demo.py")."""
    return Path(item.path).resolve().relative_to(TESTS).as_posix()


def listed(item: pytest.Item, names: set[str]) -> bool:
    """The test's module, or the module and its function, is in `names`."""
    module = module_of(item)
    return module in names or f"{module}::{item.originalname}" in names


def group_of(item: pytest.Item) -> str:
    """The xdist group the test runs in: "ray", "sft_model", or its own module's (see the module docstring)."""
    if "ray_cluster" in item.fixturenames or listed(item, RAY):
        return "ray"
    if "sft_model_dir" in item.fixturenames:
        return "sft_model"
    return module_of(item)


def is_slow(item: pytest.Item) -> bool:
    return listed(item, SLOW) or bool(SLOW_FIXTURES & set(item.fixturenames))


def mark(items: list[pytest.Item]) -> None:
    """Add the `slow` and `xdist_group` marks (see the module docstring)."""
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)
        item.add_marker(pytest.mark.xdist_group(group_of(item)))
