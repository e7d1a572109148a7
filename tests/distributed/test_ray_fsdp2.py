"""`train_ppo_ray` GRPO with the RL roles on FSDP2 (issue 20, acceptance 1, its RL part): the actor on 2 ranks and the
reference on 2 ranks, both `--backend fsdp2` (fp32, gloo), against DeepSpeed ZeRO-0 at world 1: the same losses
every step and the same final weights to 1e-5; also with the actor's CPU offload (`--adam_offload`). Each run's
weights reach the rollout engine from the shards (one `full_tensor()` per parameter), and the engine's log-probs of
what it sampled equal the trainer's (< 1e-4).

Both runs see the same samples: the Transformers rollout engine samples from the seed alone, and the actor's weights
are the same after every step, so the same tokens come back; the trainers weight each micro-batch by the whole
step's totals (`rlhfkit.rl.replay_buffer`), so 2 ranks x 2 micro-batches of 1 are 1 rank x 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.rl.ray_run import run_ppo_ray

REWARD = str(Path(__file__).with_name("reward_exact_match.py"))
STEPS = 5  # the 5 optimizer steps


def argv(assets, out: Path, *extra: str) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--prompt_data", str(assets.rl_train), "--input_key", "prompt",
            "--label_key", "answer", "--input_template", "User: {}\nAssistant: ", "--max_samples", str(2 * STEPS),
            "--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--micro_rollout_batch_size", "1",
            "--train_batch_size", "4", "--micro_train_batch_size", "1", "--generate_max_len", "8",
            "--prompt_max_len", "32", "--actor_learning_rate", "5e-3", "--advantage_estimator", "group_norm",
            "--remote_rm_url", REWARD, "--use_kl_loss", "--kl_estimator", "k3", "--init_kl_coef", "0.01",
            "--vllm_num_engines", "0", "--param_dtype", "fp32", "--save_path", str(out),
            "--disable_progress_bar", *extra]


def offload_probe(role) -> dict:
    """On one actor rank: how its FSDP2 units offload, where its shards and AdamW state live, the sleep counters."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor

    from rlhfkit.distributed import weight_sync

    engine = weight_sync.policy_module(role)
    groups = [fully_shard.state(m)._fsdp_param_group for m in engine.module.modules() if isinstance(m, FSDPModule)]
    params = list(engine.module.parameters())
    moments = [t for s in engine.optimizer.state.values() for t in s.values() if t.dim() > 0]
    return {"policies": {type(g.offload_policy).__name__ for g in groups if g is not None},
            "shards": all(isinstance(p, DTensor) and p.to_local().device.type == "cpu" for p in params),
            "moments": len(moments) > 0 and all(isinstance(t, DTensor) and t.device.type == "cpu" for t in moments),
            "sleep": dict(weight_sync.SLEEP_STATS)}


def rows(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/actor/policy_loss" in r]


@pytest.fixture(scope="module")
def zero0_run(ray_cluster, demo_assets, tmp_path_factory) -> tuple[Path, list[dict[str, torch.Tensor]]]:
    """The reference run, shared by the cases below: DeepSpeed ZeRO-0, actor and reference on one rank each. With
    its output folder come the actor's weights after every weight sync (the first, then one per step)."""
    out = tmp_path_factory.mktemp("zero0")
    synced: list[dict[str, torch.Tensor]] = []
    run_ppo_ray(parse_config(PPOConfig, argv(demo_assets, out, "--zero_stage", "0", "--actor_num_gpus_per_node",
                                             "1", "--ref_num_gpus_per_node", "1"), "test"),
                after_sync=[lambda trainer: synced.append(trainer.actor.state_dict())])
    return out, synced


# sharded: the 5 steps. offload: CPUOffloadPolicy holds the actor's shards, their gradients and the AdamW state in
# CPU memory (torch's AdamW steps them there) and the engine's weights come from the offloaded shards; with the
# hybrid engine's sleep/wake around every call too (it moves nothing of an offloaded model: its shards are already
# in CPU memory). It stops after 2 of the 5 steps (the LR schedule is the 5-step run's) to keep the suite's time:
# bench/fsdp2_rl_offload.py runs the 5 steps (bench/results/fsdp2_rl_offload.md).
FSDP2_CASES = {"sharded": (STEPS, []), "offload": (2, ["--adam_offload", "--deepspeed_enable_sleep"])}


@pytest.mark.limit(300)
@pytest.mark.parametrize("case", list(FSDP2_CASES))
def test_grpo_actor_and_reference_on_two_fsdp2_ranks_match_zero0_at_world_1(zero0_run, demo_assets, tmp_path, case):
    from safetensors.torch import load_file

    (one, synced), two = zero0_run, tmp_path / "fsdp2"
    steps, flags = FSDP2_CASES[case]
    probes: list[list[dict]] = []
    run_ppo_ray(parse_config(PPOConfig, argv(demo_assets, two, "--backend", "fsdp2", "--actor_num_gpus_per_node",
                                             "2", "--ref_num_gpus_per_node", "2", "--max_rl_steps", str(steps),
                                             *flags), "test"),
                after_sync=[lambda trainer: probes.append(trainer.actor.run_on_ranks(offload_probe))])
    # after every weight sync (the first, and one per step), on both actor ranks: the FSDP2 units offload (or not)
    # as asked, every parameter and AdamW moment is a CPU shard, and with sleep every call went through wake/sleep
    assert len(probes) == steps + 1 and all(len(ranks) == 2 for ranks in probes)
    policy = "CPUOffloadPolicy" if case == "offload" else "OffloadPolicy"
    for ranks in probes[1:]:  # the moments exist from the first step on
        assert all(r["policies"] == {policy} and r["shards"] and r["moments"] for r in ranks), ranks
    reloads = [r["sleep"]["reloads"] for r in probes[-1]]
    assert all(n >= 2 * steps for n in reloads) if case == "offload" else reloads == [0, 0], reloads

    base, sharded = rows(one)[:steps], rows(two)
    assert len(base) == len(sharded) == steps
    keys = ("train/actor/policy_loss", "train/actor/kl_loss")
    print(case, "max loss gap", max(abs(a[k] - b[k]) for a, b in zip(base, sharded) for k in keys),
          "max engine/trainer log-prob gap", max(b["train/rollout_logprob_diff"] for b in sharded))
    for a, b in zip(base, sharded):
        for key in ("train/actor/policy_loss", "train/actor/kl_loss", "train/reward"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), (a["step"], key)
        # the engine sampled with the weights synced from the shards: its log-probs are the trainer's
        assert b["train/rollout_logprob_diff"] < 1e-4, b["train/rollout_logprob_diff"]
    b = load_file(str(two / "model.safetensors"))
    a = {k: synced[steps][k] for k in b}  # ZeRO-0's weights after as many steps (the sync also names a tied head)
    assert all(b[k].dtype == torch.float32 for k in b)
    start = load_file(str(demo_assets.model_dir / "model.safetensors"))
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    gap = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(case, "max weight gap", gap, "largest weight change over the run", moved)
    assert gap < 1e-5 and moved > 1e-3  # the runs trained, and to the same weights
    if steps == STEPS:  # the whole run: ZeRO-0's synced weights are the ones it saved
        saved = load_file(str(one / "model.safetensors"))
        assert all(torch.equal(saved[k], a[k]) for k in saved)


@pytest.mark.limit(300)
def test_gae_critic_and_reward_model_on_two_fsdp2_ranks(ray_cluster, demo_assets, demo_reward_model, tmp_path):
    """PPO with a critic (trained) and a reward model (forward only), both on 2 FSDP2 ranks: one step runs. No KL
    term, so no reference: the reference on FSDP2 ranks is the test above's (two Ray actors fewer to start here)."""
    out = tmp_path / "gae"
    flags = argv(demo_assets, out, "--backend", "fsdp2", "--actor_num_gpus_per_node", "2",
                 "--critic_num_gpus_per_node", "2", "--reward_num_gpus_per_node", "2", "--colocate_all_models",
                 "--max_rl_steps", "1")
    flags = [f for f in flags if f != "--use_kl_loss"]
    i = flags.index("--init_kl_coef")
    flags[i + 1] = "0"
    i = flags.index("--advantage_estimator")
    flags[i + 1] = "gae"
    i = flags.index("--remote_rm_url")
    flags[i:i + 2] = ["--reward_pretrain", str(demo_reward_model), "--critic_pretrain", str(demo_assets.model_dir),
                      "--critic_init_head", "--critic_learning_rate", "5e-3"]
    run_ppo_ray(parse_config(PPOConfig, flags, "test"))
    (step,) = rows(out)
    assert "train/critic/value_loss" in step and step["train/rollout_logprob_diff"] < 1e-4
