"""RL on image prompts from the CLI (2 GRPO steps on the tiny Qwen2-VL): `train_ppo` with OpenRLHF's
`--data.image_key images --data.max_images_per_prompt 1 --actor.freeze_visual_encoder` trains the language model,
leaves the vision tower bit-identical and syncs only the language model's tensors to the engine; the engine's and
the trainer's log-probs of the sampled image prompts agree."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from tests.cli.test_preference_cli import cli, ok

# A reward that varies within a group on an untrained model (exact-match answers would all score 0, leaving GRPO's
# advantages zero and nothing to train): 1 for an odd-length response.
REWARD = '''import torch

def reward_func(queries, prompts, labels):
    return torch.tensor([float(len(q) - len(p)) % 2 for q, p in zip(queries, prompts)])
'''

GRPO = ["--input_key", "prompt", "--label_key", "answer", "--apply_chat_template", "--data.image_key", "images",
        "--data.max_images_per_prompt", "1", "--actor.freeze_visual_encoder", "--advantage_estimator", "group_norm",
        "--n_samples_per_prompt", "4", "--rollout_batch_size", "2", "--train_batch_size", "8",
        "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "8", "--generate_max_len", "8",
        "--prompt_max_len", "64", "--max_rl_steps", "2", "--actor_learning_rate", "1e-3", "--disable_progress_bar"]


def steps(save: Path) -> list[dict]:
    return [r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if r.get("step")]


def check_frozen_vision(model_dir: Path, save: Path) -> tuple[int, int]:
    """(vision tensors, language-model tensors) of the model; the vision ones are bit-identical after training and
    some language-model ones changed."""
    before, after = load_file(model_dir / "model.safetensors"), load_file(save / "model.safetensors")
    vision = [k for k in before if "visual." in k]
    assert vision and all(before[k].equal(after[k]) for k in vision)
    assert sum(not before[k].equal(after[k]) for k in before if k not in vision) > 0
    return len(vision), len(before) - len(vision)


def test_train_ppo_grpo_on_image_prompts_freezes_and_skips_the_vision_tower(vlm_assets, tmp_path):
    from rlhfkit.models.loading import load_causal_lm

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    save = tmp_path / "grpo"
    ok(cli("train_ppo", "--pretrain", str(vlm_assets.model_dir), "--prompt_data", str(vlm_assets.split("rl_train")),
           "--remote_rm_url", str(reward), "--save_path", str(save), *GRPO))
    check_frozen_vision(vlm_assets.model_dir, save)
    records = steps(save)
    assert len(records) == 2
    state = load_causal_lm(str(vlm_assets.model_dir)).state_dict()
    language = [k for k in state if not k.startswith("model.visual.")]
    for r in records:
        assert r["train/sync/tensors"] == len(language) < len(state)  # the language model's tensors only
        assert r["train/rollout_logprob_diff"] < 1e-4  # engine vs trainer on the same image prompts (fp32)
