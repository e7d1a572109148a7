"""examples/agent_image_feedback.py trains 2 RL steps (train_ppo in this process, REINFORCE++-baseline on packed
rows; GRPO runs in test_ray_vlm) on the tiny Qwen2-VL: every trained sample holds one image per turn (the prompt's,
then one per feedback), each feedback image's vision tokens sit in the response with action mask 0, the policy never
samples one, the trainer's packed forward gives the engine's log-probs, and the weights move."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from rlhfkit.config.base import parse_config
from rlhfkit.config.rl import PPOConfig
from rlhfkit.rl.experience import Experience

AGENT = Path(__file__).parents[2] / "examples" / "agent_image_feedback.py"


def runs(flags: list[bool]) -> int:
    """How many runs of consecutive True values `flags` holds."""
    return sum(1 for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1]))


def test_two_rl_steps_train_the_image_feedback_agent(vlm_assets, tmp_path, monkeypatch, world_of_one):
    from rlhfkit.rl.local_run import run_ppo
    from rlhfkit.rl.roles import ActorRole

    trained: list[Experience] = []
    train = ActorRole.train

    def recording(self, batch, *args, **kwargs):
        trained.append(batch if isinstance(batch, Experience) else Experience.from_dict(batch))
        return train(self, batch, *args, **kwargs)

    monkeypatch.setattr(ActorRole, "train", recording)
    monkeypatch.chdir(tmp_path)  # the default --ckpt_path is relative
    save = tmp_path / "out"
    argv = ["--pretrain", str(vlm_assets.model_dir), "--prompt_data", str(vlm_assets.split("rl_train")),
            "--input_key", "prompt", "--label_key", "answer", "--image_key", "images", "--max_images_per_prompt", "1",
            "--apply_chat_template", "--agent_func_path", str(AGENT), "--max_steps", "3", "--packing_samples",
            "--advantage_estimator", "reinforce_baseline", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2",
            "--train_batch_size", "4", "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4",
            "--generate_max_len", "96", "--prompt_max_len", "64", "--max_rl_steps", "2", "--init_kl_coef", "0",
            "--actor_learning_rate", "1e-3", "--zero_stage", "0", "--save_path", str(save), "--disable_progress_bar"]
    run_ppo(parse_config(PPOConfig, argv, "train_ppo"))

    steps = [r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines())
             if "train/actor/policy_loss" in r]
    assert len(steps) == 2 and all(s["train/agent/failures"] == 0 for s in steps)
    # the trainer's packed forward of the episodes, feedback images included, gives the engine's log-probs (fp32)
    assert all(s["train/rollout_logprob_diff"] < 1e-4 for s in steps)
    assert (save / "model.safetensors").is_file() and len(trained) == 2
    image_token = json.loads((vlm_assets.model_dir / "config.json").read_text())["image_token_id"]
    turns_seen = []
    for exp in trained:
        assert exp.images is not None and len(exp.images) == len(exp) == 4
        for i in range(len(exp)):
            start, end = int(exp.prompt_lengths[i]), int(exp.attention_mask[i].sum())
            response = exp.sequences[i, start:end]
            action = exp.action_mask[i, :end - start]
            turns = runs(action.tolist())  # a turn's sampled tokens, then its feedback (mask 0)
            images = exp.images[i]
            assert images is not None and images["image_grid_thw"].shape[0] == turns  # prompt's + one per feedback
            assert int((exp.sequences[i, :start] == image_token).sum()) == 4  # the prompt's image
            assert int((response[~action] == image_token).sum()) == 4 * (turns - 1)  # each feedback's, mask 0
            assert not bool((response[action] == image_token).any())  # never sampled
            turns_seen.append(turns)
    assert max(turns_seen) >= 2, turns_seen  # some episodes got image feedback
    # the format reward varies within groups, so the updates move the policy
    assert any(s["train/reward_std"] > 0 for s in steps)
    before, after = load_file(vlm_assets.model_dir / "model.safetensors"), load_file(save / "model.safetensors")
    assert sum(not torch.equal(before[k], after[k]) for k in before) > 0
