"""`train_ppo_ray` on image prompts in the shape of OpenRLHF's VLM example (hybrid engine: --colocate_all_models,
`--data.image_key images --data.max_images_per_prompt 1 --actor.freeze_visual_encoder`, GRPO with a reward function)
for 2 steps on the tiny Qwen2-VL: the vision tower stays bit-identical, every weight sync moves the language model's
tensors only, the engine's and the trainer's log-probs of the sampled image prompts agree (fp32), and a run that
asks for vLLM engines says once why it generates on the Transformers engine. PPO with a critic and a reward model
on the vision-language base (GAE) runs 2 steps the same way."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.rl.ray_run import run_ppo_ray

# Varies within a group on an untrained model (exact-match answers would all score 0, leaving GRPO nothing to
# train): 1 for an odd-length response.
# It also checks that each sample's image reference reaches it (`images=`): one existing file per prompt.
REWARD = '''import os

import torch

def reward_func(queries, prompts, labels, images=None):
    assert images is not None and len(images) == len(queries), images
    assert all(len(refs) == 1 and os.path.isfile(refs[0]) for refs in images), images
    return torch.tensor([float(len(q) - len(p)) % 2 for q, p in zip(queries, prompts)])
'''


def vlm_grpo_argv(assets, reward, save) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--prompt_data", str(assets.split("rl_train")),
            "--input_key", "prompt", "--label_key", "answer", "--apply_chat_template",
            "--ref_num_nodes", "1", "--ref_num_gpus_per_node", "1", "--actor_num_nodes", "1",
            "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "1",
            "--colocate_all_models", "--vllm_enable_sleep", "--vllm_gpu_memory_utilization", "0.6",
            "--advantage_estimator", "group_norm", "--use_kl_loss", "--init_kl_coef", "1e-3", "--kl_estimator", "k3",
            "--remote_rm_url", str(reward), "--data.image_key", "images", "--data.max_images_per_prompt", "1",
            "--actor.freeze_visual_encoder", "--n_samples_per_prompt", "4", "--rollout_batch_size", "2",
            "--train_batch_size", "8", "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "8",
            "--generate_max_len", "8", "--prompt_max_len", "64", "--max_rl_steps", "2",
            "--actor_learning_rate", "1e-3", "--save_path", str(save), "--disable_progress_bar"]


@pytest.mark.limit(240)
def test_grpo_on_image_prompts_hybrid_engine_frozen_vision(ray_cluster, vlm_assets, tmp_path, capsys):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    save = tmp_path / "final"
    run_ppo_ray(parse_config(PPOConfig, vlm_grpo_argv(vlm_assets, reward, save), "test"))
    out = capsys.readouterr().out
    assert out.count("image prompts generate on the Transformers engine") == 1, out
    before, after = load_file(vlm_assets.model_dir / "model.safetensors"), load_file(save / "model.safetensors")
    vision = [k for k in before if "visual." in k]
    language = [k for k in before if k not in vision]
    assert vision and all(before[k].equal(after[k]) for k in vision)  # bit-identical
    assert (save / "preprocessor_config.json").is_file()  # the saved policy is a complete --pretrain
    assert sum(not before[k].equal(after[k]) for k in language) > 0
    steps = [r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if r.get("step")]
    assert len(steps) == 2
    for s in steps:
        # each sync: the language model's tensors only (the tied LM head is not a tensor of its own)
        assert s["train/sync/tensors"] == len(language), (s["train/sync/tensors"], len(language), len(vision))
        assert s["train/rollout_logprob_diff"] < 1e-4  # engine vs trainer on the same image prompts (fp32)


def vision_reward_model(assets, out) -> str:
    """A reward model on the tiny Qwen2-VL (its value head as initialised, saved with a head: a --reward_pretrain)."""
    import torch

    from rlhfkit.models.value_model import load_value_model

    torch.manual_seed(0)
    load_value_model(str(assets.model_dir), flag="--pretrain", require_head=False).save_pretrained(out)
    return str(out)


@pytest.mark.limit(240)
def test_ppo_with_a_critic_and_an_image_reward_model_on_ray(ray_cluster, vlm_assets, tmp_path):
    save = tmp_path / "final"
    argv = ["--pretrain", str(vlm_assets.model_dir), "--prompt_data", str(vlm_assets.split("rl_train")),
            "--input_key", "prompt", "--apply_chat_template", "--data.image_key", "images",
            "--reward_pretrain", vision_reward_model(vlm_assets, tmp_path / "rm"), "--advantage_estimator", "gae",
            "--colocate_all_models", "--rollout_batch_size", "4", "--train_batch_size", "4",
            "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4", "--generate_max_len", "8",
            "--prompt_max_len", "64", "--max_rl_steps", "2", "--init_kl_coef", "0", "--save_path", str(save),
            "--disable_progress_bar"]  # no KL: no reference actor to start
    run_ppo_ray(parse_config(PPOConfig, argv, "test"))
    steps = [r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if r.get("step")]
    assert len(steps) == 2 and all("train/critic/value_loss" in s for s in steps)
