"""The specs derived once from a validated config (rlhfkit/config/specs.py, rl_specs.py): what each role, the engines
and the placement get, and the placement's flag rules, which fail at parse time (one line) instead of when Ray
starts."""

from __future__ import annotations

import dataclasses
import pickle
import shlex

import pytest

from rlhfkit.config.base import parse_config
from rlhfkit.config.batch_inference import BatchInferenceConfig, engine_spec
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.rl_specs import rl_specs
from rlhfkit.errors import UserError

BASE = ("--pretrain m --prompt_data p.jsonl --rollout_batch_size 16 --n_samples_per_prompt 2 "
        "--train_batch_size 32 --micro_train_batch_size 2 --micro_rollout_batch_size 4 ")
GRPO = "--advantage_estimator group_norm --remote_rm_url http://127.0.0.1:1/get_reward "


def parsed(text: str) -> PPOConfig:
    return parse_config(PPOConfig, shlex.split(BASE + text), "t")


def test_grpo_run_has_actor_reference_and_engine_only():
    specs = rl_specs(parsed(GRPO + "--use_kl_loss --clip_eps_high 0.28 --temperature 0.7 --packing_samples"))
    assert specs.critic is None and specs.reward is None and specs.ref is not None
    a = specs.actor
    assert (a.clip_low, a.clip_high, a.temperature, a.loss_agg, a.loss_norm_len) == (0.2, 0.28, 0.7, "token_mean",
                                                                                     None)
    assert a.batch.packed and a.batch.micro_rollout_batch_size == 4 and a.batch.max_tokens_per_gpu is None
    assert specs.ref.temperature == 0.7 and specs.ref.path == "m"
    assert specs.placement.role_ranks == (("actor", 1), ("ref", 1))
    assert (specs.engine.backend, specs.engine.num_engines, specs.engine.max_batch_size) == ("transformers", 1, 256)


def test_ppo_with_critic_and_reward_model():
    specs = rl_specs(parsed("--reward_pretrain rm --critic_pretrain c --value_head_prefix v --normalize_reward "
                            "--init_kl_coef 0 --enable_vllm_is_correction --vllm_is_truncated_threshold 0.5 3"))
    assert specs.ref is None
    assert (specs.critic.path, specs.critic.value_head_prefix, specs.critic.require_head) == ("c", "v", True)
    assert (specs.reward.path, specs.reward.normalize) == ("rm", True)
    assert (specs.actor.is_correction, specs.actor.is_low, specs.actor.is_high) == (True, 0.5, 3.0)
    assert [role for role, _ in specs.placement.role_ranks] == ["actor", "critic", "reward"]


def test_dr_grpo_normalises_by_generate_max_len_and_dynamic_batch_sets_the_token_budget():
    specs = rl_specs(parsed(GRPO.replace("group_norm", "dr_grpo") + "--generate_max_len 64 --prompt_max_len 32 "
                            "--use_dynamic_batch --max_tokens_per_gpu 512 --enable_ema --ema_beta 0.9"))
    assert (specs.actor.loss_agg, specs.actor.loss_norm_len) == ("seq_mean_token_sum_norm", 64)
    assert specs.actor.batch.max_tokens_per_gpu == 512 and specs.actor.ema_beta == 0.9
    assert specs.engine.max_model_len == 32 + 64 + 1


def test_vllm_engines_and_hybrid_placement():
    cfg = parsed(GRPO + "--vllm_num_engines 2 --vllm_tensor_parallel_size 1 --colocate_all_models "
                        "--actor_num_gpus_per_node 2 --deepspeed_enable_sleep --vllm_enable_sleep --bf16 --seed 5 "
                        "--init_kl_coef 0 --vllm_sync_backend gloo")
    specs = rl_specs(cfg)
    e, p = specs.engine, specs.placement
    assert (e.backend, e.num_engines, e.bf16, e.seed, e.enable_sleep) == ("vllm", 2, True, 5, True)
    assert (p.engine_role, p.engine_ranks, p.colocate_all, p.sync_backend) == ("vllm", 2, True, "gloo")
    assert p.offload_between_calls == ("actor",)
    single = rl_specs(cfg, single_process=True).engine  # train_ppo always generates with the Transformers engine
    assert (single.backend, single.num_engines) == ("transformers", 1)


def test_specs_are_frozen_copies_and_travel_to_ray_actors():
    cfg = parsed(GRPO)
    specs = rl_specs(cfg)
    cfg.model.pretrain = "changed later"
    assert specs.actor.model.pretrain == "m"  # a copy, not the config's section
    with pytest.raises(dataclasses.FrozenInstanceError):
        specs.actor.temperature = 2.0  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(specs)) == specs


@pytest.mark.parametrize("text, needle", [
    (GRPO + "--colocate_actor_ref --actor_num_gpus_per_node 2 --ref_num_gpus_per_node 4",
     "--colocate_actor_ref: ref needs 4 devices but the actor has 2; give the ref at most as many"),
    ("--reward_pretrain rm --advantage_estimator gae --colocate_critic_reward --reward_num_gpus_per_node 2",
     "--colocate_critic_reward: reward needs 2 devices but the critic has 1"),
    (GRPO + "--ref_num_gpus_per_node 3",
     "32 samples per step (--rollout_batch_size x --n_samples_per_prompt) do not split evenly over the 3 ref ranks"),
    (GRPO + "--ref_num_gpus_per_node 16 --micro_train_batch_size 4",
     "--train_batch_size 32 is not divisible by --micro_train_batch_size 4 x ref ranks"),
])
def test_placement_rules_fail_at_parse_time(text, needle):
    with pytest.raises(UserError) as e:
        parsed(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_batch_inference_engine_spec():
    cfg = parse_config(BatchInferenceConfig, shlex.split(
        "--eval_task generate_vllm --pretrain m --dataset d.jsonl --output_path o.jsonl --num_engines 2 "
        "--max_num_seqs 8 --prompt_max_len 20 --max_new_tokens 10 --micro_batch_size 4 --seed 3"), "t")
    e = engine_spec(cfg)
    assert (e.backend, e.num_engines, e.max_num_seqs, e.max_model_len, e.max_batch_size, e.seed) == (
        "vllm", 2, 8, 31, 4, 3)
    assert e.placement_role == "vllm" and not e.enforce_eager
