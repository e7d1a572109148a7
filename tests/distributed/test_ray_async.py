"""Asynchronous RL (--async_train) through Ray: a generator actor fills a bounded queue while the actor trains.

Instrumented runs check the two invariants of rlhfkit/trainers/async_generator.py: no generate call overlaps a
weight update (the generator records the lock intervals of both), and every consumed batch is at most
--async_queue_size policy versions behind the trainer. Also: agents train asynchronously, a killed generator stops
the run within 60 s naming it, and a resumed async run continues at the consumed data position.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.trainers.ray_run import run_ppo_ray
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
    trainer = run_ppo_ray(parse_config(PPOConfig, grpo_argv(demo_assets, tmp_path, *extra), "test"))
    assert len(trainer.consumed) == 6  # 3 episodes x 2 batches, nothing skipped or repeated
    for c in trainer.consumed:
        assert 0 <= c["trainer_version"] - c["sample_version"] <= queue, trainer.consumed
    assert max(c["trainer_version"] - c["sample_version"] for c in trainer.consumed) >= 1  # it did overlap
    stats = trainer.last_generator_stats
    assert_no_overlap(stats)
    assert len(stats["intervals"]["update"]) == 6  # one weight update per step (the first sync precedes it)
    rows = [r for r in rows_of(tmp_path / "final" / "metrics.jsonl") if "train/actor/policy_loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(0 <= r["train/async/staleness"] <= queue for r in rows)
    if partial:
        # 8 new tokens in chunks of 3: three generate calls per batch, each a point where an update may land
        assert len(stats["intervals"]["generate"]) >= 3 * 6
