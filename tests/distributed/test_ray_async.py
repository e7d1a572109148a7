"""Asynchronous RL (--async_train) through Ray: a generator actor fills a bounded queue while the actor trains.

Instrumented runs check the two invariants of rlhfkit/rl/async_generator.py: no generate call overlaps a
weight update (the generator records the lock intervals of both), and every consumed batch is at most
--async_queue_size policy versions behind the trainer. Also: agents train asynchronously (with partial rollout
too), a killed generator (running agent episodes across updates) stops the run within 60 s naming it, and a
resumed async run continues at the consumed data position (with oversampled batches in the queue).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.rl.ray_run import run_ppo_ray
from tests.distributed.test_ray_ppo import ppo_argv

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REWARD = str(Path(__file__).resolve().parent / "reward_exact_match.py")


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def grpo_argv(assets, out: Path, *extra: str) -> list[str]:
    return ppo_argv(assets, out, "--remote_rm_url", REWARD, "--advantage_estimator", "group_norm",
                    "--init_kl_coef", "0", "--async_train", *extra)


def assert_no_overlap(stats: dict) -> None:
    generate, update = stats["intervals"]["generate"], stats["intervals"]["update"]
    assert generate and update
    for g0, g1 in generate:
        for u0, u1 in update:
            assert g1 <= u0 or u1 <= g0, f"generate {g0, g1} overlaps weight update {u0, u1}"


@pytest.mark.limit(400)
@pytest.mark.parametrize("queue, partial", [(1, False), (2, True)], ids=["queue1", "queue2-partial"])
def test_staleness_bound_and_lock(ray_cluster, demo_assets, tmp_path, queue, partial):
    extra = ["--async_queue_size", str(queue), "--num_episodes", "3"]
    if partial:
        extra += ["--partial_rollout", "--partial_rollout_chunk_len", "3", "--enable_vllm_is_correction"]
    supply = run_ppo_ray(parse_config(PPOConfig, grpo_argv(demo_assets, tmp_path, *extra), "test")).supply
    assert len(supply.consumed) == 6  # 3 episodes x 2 batches, nothing skipped or repeated
    for c in supply.consumed:
        assert 0 <= c["trainer_version"] - c["sample_version"] <= queue, supply.consumed
        # one optimizer step per batch and no KL in the reward: the old policy is the actor's current weights, which
        # the training forward computes exactly, stale batch or not (no extra actor forward)
        assert not c["old_log_probs_from_actor_forward"], c
    assert max(c["trainer_version"] - c["sample_version"] for c in supply.consumed) >= 1  # it did overlap
    stats = supply.last_generator_stats
    assert_no_overlap(stats)
    assert len(stats["intervals"]["update"]) == 6  # one weight update per step (the first sync precedes it)
    rows = [r for r in rows_of(tmp_path / "final" / "metrics.jsonl") if "train/actor/policy_loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(0 <= r["train/async/staleness"] <= queue for r in rows)
    if partial:
        # 8 new tokens in chunks of 3: three generate calls per batch, each a point where an update may land
        assert len(stats["intervals"]["generate"]) >= 3 * 6


AGENT_PARTIAL = ["--partial_rollout", "--partial_rollout_chunk_len", "2", "--enable_vllm_is_correction",
                 "--agent_func_path", str(Path(__file__).resolve().parents[1] / "rl" / "agent_short_turns.py")]


@pytest.mark.limit(400)
def test_agent_trains_two_async_steps(ray_cluster, demo_assets, tmp_path):
    """OpenRLHF's agent command shape (--async_train --agent_func_path ... --max_steps 3, REINFORCE++). Its partial
    rollout form runs in `test_killed_generator_stops_the_run_naming_it`, which trains two steps before the kill."""
    argv = ppo_argv(demo_assets, tmp_path, "--async_train", "--agent_func_path", str(EXAMPLES / "agent_func.py"),
                    "--max_steps", "3", "--advantage_estimator", "reinforce", "--init_kl_coef", "0.01",
                    "--generate_max_len", "24")
    supply = run_ppo_ray(parse_config(PPOConfig, argv, "test")).supply
    rows = [r for r in rows_of(tmp_path / "final" / "metrics.jsonl") if "train/actor/policy_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(1 <= r["train/agent/turns"] <= 3 and r["train/async/staleness"] <= 1 for r in rows)
    assert [c["position"] for c in supply.consumed] == [(0, 1), (0, 2)]
    assert_no_overlap(supply.last_generator_stats)
    assert (tmp_path / "final" / "model.safetensors").is_file()


def assert_partial_agent_steps(run_dir: Path, queue: int) -> None:
    """The steps of a --partial_rollout agent run (AGENT_PARTIAL), 1 and 2 at least: episodes of 4-token turns
    spanned the weight updates, with per-token versions in the metrics and in samples.jsonl and staleness within
    the queue. (That an episode continues across an update, token by token: tests/rl/partial_agent.py.)"""
    rows = [r for r in rows_of(run_dir / "metrics.jsonl") if "train/actor/policy_loss" in r]
    assert [r["step"] for r in rows][:2] == [1, 2], rows
    for r in rows:
        assert r["train/agent/turns"] == 3 and r["train/agent/feedback_tokens"] > 0, r
        assert 0 <= r["train/async/token_staleness_mean"] <= r["train/async/staleness"] <= queue, r
    samples = rows_of(run_dir / "samples.jsonl")
    assert samples
    for sample in samples:  # every response token's version
        versions = sample["policy_versions"]
        assert len(versions) > 3 * 4 and versions == sorted(versions), sample  # 3 turns and feedback
        assert 0 <= (sample["step"] - 1) - versions[0] <= queue, sample  # trainer version - sampling version


@pytest.mark.limit(300)
def test_killed_generator_stops_the_run_naming_it(ray_cluster, demo_assets, tmp_path):
    import os
    import signal
    import time

    from rlhfkit.errors import ComponentFailed

    killed: list[float] = []
    supplies: list[Any] = []

    def kill_generator(trainer):
        if trainer.supply.generator is not None:
            supplies.append(trainer.supply)
        if len(supplies) == 3 and not killed:  # after step 3's update, mid-run (of 6), steps 1-2 logged
            os.kill(trainer.supply.generator_pid, signal.SIGKILL)
            killed.append(time.monotonic())

    # the generator is running agent episodes across weight updates (partial rollout) when it is killed
    argv = ppo_argv(demo_assets, tmp_path, "--async_train", *AGENT_PARTIAL, "--async_queue_size", "2",
                    "--max_steps", "3", "--advantage_estimator", "reinforce", "--generate_max_len", "24",
                    "--num_episodes", "3")
    with pytest.raises(ComponentFailed, match="the rollout generator") as failure:
        run_ppo_ray(parse_config(PPOConfig, argv, "test"), after_sync=[kill_generator])
    assert killed and time.monotonic() - killed[0] < 60
    assert "died" in str(failure.value)
    # the steps trained before the kill: OpenRLHF's agent command shape with --partial_rollout
    assert [c["position"] for c in supplies[-1].consumed][:2] == [(0, 1), (0, 2)]
    assert_partial_agent_steps(tmp_path / "final", queue=2)


@pytest.mark.limit(400)
def test_resume_continues_at_the_consumed_position_with_oversampled_batches(ray_cluster, demo_assets, tmp_path):
    """Batches queued at checkpoint time are not in the checkpoint: the data position counts consumed batches
    only, so the resumed run trains on the next prompts of the stream, none skipped or repeated. With
    --vllm_generate_batch_size 4 and --rollout_batch_size 2 one engine call makes two steps' batches (the second
    waits in the queue for the next step), and the stream order is that of synchronous training."""
    from rlhfkit.data.sampler import global_batches

    argv = grpo_argv(demo_assets, tmp_path, "--max_samples", "8", "--save_steps", "1", "--async_queue_size", "2",
                     "--vllm_generate_batch_size", "4")
    first = run_ppo_ray(parse_config(PPOConfig, [*argv, "--max_rl_steps", "2"], "test")).supply
    assert [c["position"] for c in first.consumed] == [(0, 1), (0, 2)]
    resumed = run_ppo_ray(parse_config(PPOConfig, [*argv, "--load_checkpoint"], "test")).supply
    assert [c["position"] for c in resumed.consumed] == [(0, 3), (0, 4)]
    assert [c["step"] for c in resumed.consumed] == [3, 4]
    for supply in (first, resumed):
        assert all(c["trainer_version"] - c["sample_version"] <= 2 for c in supply.consumed)
        assert_no_overlap(supply.last_generator_stats)
    assert len(resumed.last_generator_stats["intervals"]["generate"]) == 1  # one engine call for steps 3 and 4
    # the prompts each run trained on are batches 0-1 and 2-3 of episode 0 in the seeded order
    batches = global_batches(8, 2, resumed.cfg.strategy.seed, 0)
    prompts = [resumed.prompts[i]["prompt"] for b in batches for i in b for _ in range(2)]
    assert first.trained_prompts == prompts[:8] and resumed.trained_prompts == prompts[8:]


@pytest.mark.limit(300)
def test_generator_error_stops_the_run_with_that_error(ray_cluster, demo_assets, tmp_path):
    """A reward function failing inside the generator (past --max_reward_failure_ratio 0) stops the run with the
    reward function's one-line error, while the trainer may be waiting for a batch or to update weights."""
    from rlhfkit.errors import UserError

    bad = tmp_path / "bad_reward.py"
    bad.write_text("def reward_func(queries, prompts, labels):\n    raise ValueError('boom on purpose')\n")
    argv = grpo_argv(demo_assets, tmp_path, "--max_reward_failure_ratio", "0")
    argv[argv.index("--remote_rm_url") + 1] = str(bad)
    with pytest.raises(UserError, match="reward_func raised ValueError: boom on purpose"):
        run_ppo_ray(parse_config(PPOConfig, argv, "test"))
