"""Which tests `make test-fast` leaves out (the `slow` mark) and which tests `make test`'s two pytest-xdist workers
run in one worker (a group); tests/conftest.py applies both. tests/README.md states the rules.

slow: a test that starts Ray, trains or generates through a CLI or a subprocess, or uses a session fixture that
does (`ray_cluster`, `sft_model_dir`). `make test-fast` (`-m "not slow"`) keeps the unit tests, a few minutes in all.

Groups: `make test` runs `-n 2`, and `GroupScheduling` (tests/group_scheduling.py) hands each group whole to one
worker, which runs it in collection order. A test's group is its module: module-scoped fixtures (trained models,
servers, engines) are built once, and a module's tests run in one process, in the order they always did. A test
whose state stays in its own process and tmp_path is safe beside any other: environment and cwd changes
(monkeypatch, `world_of_one`), in-process process groups (a world of one on a free port), subprocesses and servers
on free ports. One group spans modules, "ray": every test that starts a Ray cluster, in the test process
(`tests/distributed/ray_cluster.py`, started once per worker) or in a child (`train_ppo_ray`, `ray start`). One
worker holds them all: the in-process cluster starts once (6-8 s, 0.5 GB) instead of once per worker, two Ray
process trees (3-5 GB each with vLLM engines) never share the two cores and the memory, and the failure tests'
stop-within-seconds bounds keep their margin. One exception balances the two workers (the Ray group is the longer by
minutes): `run/test_kill_safety.py`'s Ray test runs `train_ppo_ray` in a child with a cluster of its own and gives it
45 s and more to die, so it stays in its module's group and runs beside the Ray group. (pytest-xdist's own `--dist
loadgroup` reads `xdist_group` marks but cannot rename pytest 9.2's node ids, so it falls back to one test at a time:
hence our scheduler.)

Groups with a slow test go to the workers first, the "ray" group before all: the long ones start early and the unit
tests fill the gaps at the end.
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
    "cli/test_bad_inputs.py::test_agent_file_module_level_os_exit_exits_2_in_a_real_process",
    "cli/test_bad_inputs.py::test_invalid_negative_learning_rate_exits_2_in_a_real_process",
    "cli/test_bad_inputs.py::test_malformed_data_line_exits_2_in_a_real_process",
    "cli/test_batch_inference.py",
    "cli/test_demo.py",
    "cli/test_demo_vlm.py::test_vlm_demo_runs_both_stages_reduced",
    "cli/test_interactive_chat.py",
    "cli/test_preference_cli.py",
    "cli/test_serve_teacher.py",
    "cli/test_seed_commands.py::test_scaling_keeps_every_seed_flag",
    "cli/test_seed_commands.py::test_seed_block_runs",
    "cli/test_seed_commands.py::test_seed_ray_block_runs",
    "cli/test_train_ppo_ray.py::test_cli_process_exits_2_without_starting_ray",
    "cli/test_train_ppo_ray_failures.py",
    "cli/test_train_sft.py",
    "cli/test_vlm_train.py",
    "data/test_generated_tasks.py::test_two_grpo_steps_on_a_generated_task_with_the_packaged_reward",
    "distributed/test_fsdp2_parity.py",
    "distributed/test_launch.py",
    "distributed/test_multinode.py",
    "distributed/test_ray_agents.py",
    "distributed/test_ray_async.py",
    "distributed/test_ray_groups.py",
    "distributed/test_ray_ppo.py",
    "distributed/test_ray_vlm.py",
    "distributed/test_ray_determinism.py",
    "distributed/test_universal.py",
    "distributed/test_ray_distill.py",
    "distributed/test_sequence_parallel_parity.py",
    "distributed/test_ray_fsdp2.py",
    "docs/test_docs_site.py",
    "examples/test_dapo_recipe.py",
    "examples/test_agent_image_feedback.py",
    "examples/test_agent_tools.py::test_two_rl_steps_train_the_tool_agent",
    "examples/test_env_examples.py::test_two_rl_steps_train_the_multi_tool_environment",
    "examples/test_iterative_dpo.py",
    "install/test_lock.py::test_pip_check_finds_nothing_broken",
    "install/test_wheel.py",
    "logging/test_html_report.py",
    "logging/test_tensorboard.py",
    "logging/test_trace_view.py",
    "models/test_ema.py::test_the_average_is_split_over_two_ranks_and_still_exports_the_closed_form",
    "models/test_gguf.py::test_sft_two_steps_from_a_gguf_file",
    "models/test_real_model.py",
    "models/test_sequence_parallel.py::test_split_sample_gives_one_rank_loss_and_gradients",
    "models/test_tokenizer_apart.py::test_a_ray_driver_prepares_its_run_without_the_modeling_stack",
    "rl/test_rl_sequence_parallel.py::test_rl_roles_on_a_split_sample_give_the_one_rank_numbers",
    "planner/test_plan_measured.py",
    "rewards/test_server.py::test_bad_port_fails_before_the_model_loads",
    "rewards/test_server.py::test_cli_bad_model_path_is_one_line_exit_2",
    "rewards/test_server.py::test_cli_prints_its_url_and_serves",
    "rewards/test_server.py::test_cli_no_auth_warns_and_serves_without_a_token",
    "rl/test_rl_bad_rewards.py",
    "rl/test_rl_doctor.py",
    "rl/test_distill_cli.py",
    "rl/test_rl_estimators.py",
    "rl/test_rl_learning.py",
    "rl/test_rl_recipes.py",
    "rollout/test_vllm_engine.py",
    "run/test_checkpoint.py::test_universal_checkpoint_resumes_exactly_at_another_zero_stage_and_world_size",
    "run/test_kill_safety.py",
    "run/test_preemption.py",
    "run/test_resume_cli.py",
    "test_types.py",
    "trainers/test_dpo.py",
    "trainers/test_full_determinism.py",
    "trainers/test_kto.py",
    "trainers/test_offline.py::test_nonfinite_sft_run_skips_counts_and_stops_with_its_checkpoints_intact",
    "trainers/test_reward.py",
    "trainers/test_sft.py",
}
# Session fixtures that train a model or start Ray: a test that uses one is slow.
SLOW_FIXTURES = {"ray_cluster", "sft_model_dir"}

# Modules and tests (as in SLOW) that start a Ray cluster, in this process or in a child. A whole module is named
# where its module-scoped fixtures serve its Ray tests too; a module whose fixtures are cheap (a few small files, a
# tiny model) names its Ray tests only, and its other tests run in the other worker, which builds those fixtures a
# second time (models/test_real_model.py stays whole: its fixture installs the real model into a shared cache).
# Every user of the `ray_cluster` fixture must be here.
RAY = {
    "bench/test_grpo_ray_bench.py",
    "cli/test_batch_inference.py::test_vllm_engines_on_ray_match_the_transformers_engine",
    "cli/test_demo.py",
    "cli/test_seed_commands.py::test_seed_ray_block_runs",
    "cli/test_train_ppo_ray.py",
    "cli/test_train_ppo_ray_failures.py",
    "distributed/test_multinode.py",
    "distributed/test_ray_agents.py",
    "distributed/test_ray_async.py",
    "distributed/test_ray_groups.py",
    "distributed/test_ray_ppo.py",
    "distributed/test_ray_vlm.py",
    "distributed/test_ray_determinism.py",
    "distributed/test_ray_distill.py",
    "distributed/test_ray_fsdp2.py",
    "examples/test_dapo_recipe.py",
    "models/test_real_model.py",
    "rollout/test_vllm_engine.py",
}


def split(nodeid: str) -> tuple[str, str]:
    """("cli/test_demo.py", "test_name") of "tests/cli/test_demo.py::test_name[param]"."""
    path, _, rest = nodeid.partition("::")
    return path.split("tests/", 1)[-1], rest.split("[")[0].split("::")[-1]


def listed(nodeid: str, names: set[str]) -> bool:
    """The test's module, or the module and its function, is in `names`."""
    module, function = split(nodeid)
    return module in names or f"{module}::{function}" in names


def group_of(nodeid: str) -> str:
    """The group the test runs in under xdist: "ray" or its module (see the module docstring)."""
    return "ray" if listed(nodeid, RAY) else split(nodeid)[0]


def is_slow(item: pytest.Item) -> bool:
    return listed(item.nodeid, SLOW) or bool(SLOW_FIXTURES & set(item.fixturenames))


def mark_and_order(items: list[pytest.Item], under_xdist: bool) -> None:
    """Mark the slow tests; under xdist, order the groups as the workers should take them (the module docstring).
    A user of the `ray_cluster` fixture outside RAY is an error: it would start a second cluster beside the first."""
    slow_groups = {"ray"}
    for item in items:
        if "ray_cluster" in item.fixturenames and group_of(item.nodeid) != "ray":
            raise pytest.UsageError(f"{item.nodeid} uses the ray_cluster fixture: add its module to RAY in {__file__}")
        if is_slow(item):
            item.add_marker(pytest.mark.slow)
            slow_groups.add(group_of(item.nodeid))
    if under_xdist:
        rank = {"ray": 0, **{group: 1 for group in slow_groups - {"ray"}}}
        items.sort(key=lambda item: rank.get(group_of(item.nodeid), 2))  # stable: collection order within a rank
