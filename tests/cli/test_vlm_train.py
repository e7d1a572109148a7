"""The offline trainers on image prompts, from their CLIs (2 steps each on the tiny Qwen2-VL): SFT with OpenRLHF's
`--data.image_key` and `--actor.freeze_visual_encoder` (on packed rows: `--packing_samples`) leaves the vision tower
bit-identical, and its output feeds DPO and KTO directly (the image processor is saved with the model); train_rm
trains a value head on the vision-language base, packed, with the vision tower frozen, and train_ppo runs GAE with a
critic and that reward model on image prompts."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from tests.cli.test_preference_cli import cli, ok

COMMON = ["--apply_chat_template", "--data.image_key", "images", "--train_batch_size", "4",
          "--micro_train_batch_size", "2", "--max_steps", "2", "--max_len", "64", "--disable_progress_bar"]


def steps(save: Path) -> int:
    return sum(1 for line in (save / "metrics.jsonl").read_text().splitlines() if json.loads(line).get("step"))


def test_sft_dpo_and_kto_train_two_steps_on_image_prompts(vlm_assets, tmp_path, capsys):
    sft = tmp_path / "sft"
    ok(cli(capsys, "train_sft", "--pretrain", str(vlm_assets.model_dir), "--dataset",
           str(vlm_assets.split("sft_train")),
           "--input_key", "prompt", "--output_key", "answer", "--actor.freeze_visual_encoder", "--packing_samples",
           "--save_path",
           str(sft), *COMMON))
    before, after = load_file(vlm_assets.model_dir / "model.safetensors"), load_file(sft / "model.safetensors")
    vision = [k for k in before if "visual" in k]
    assert vision and all(before[k].equal(after[k]) for k in vision)
    assert sum(not before[k].equal(after[k]) for k in before if k not in vision) > 0
    assert (sft / "preprocessor_config.json").is_file()

    dpo = tmp_path / "dpo"
    ok(cli(capsys, "train_dpo", "--pretrain", str(sft), "--dataset", str(vlm_assets.split("pref_train")),
           "--prompt_key", "prompt", "--save_path", str(dpo), *COMMON))
    kto_data = tmp_path / "kto.jsonl"
    kto_data.write_text("".join(json.dumps({"prompt": r["prompt"], "images": r["images"], "completion": r[side],
                                            "label": side == "chosen"}) + "\n"
                                for r in vlm_assets.read("pref_train")[:8] for side in ("chosen", "rejected")))
    # the relative image paths are resolved next to the data file they came from
    for r in vlm_assets.read("pref_train")[:8]:
        (tmp_path / r["images"][0]).parent.mkdir(exist_ok=True)
        (tmp_path / r["images"][0]).write_bytes((vlm_assets.data_dir / r["images"][0]).read_bytes())
    kto = tmp_path / "kto"
    ok(cli(capsys, "train_kto", "--pretrain", str(sft), "--dataset", str(kto_data), "--input_key", "prompt",
           "--output_key", "completion", "--save_path", str(kto), *COMMON))
    assert steps(sft) >= 2 and steps(dpo) >= 2 and steps(kto) >= 2


def test_rm_on_image_pairs_then_ppo_with_a_critic_and_that_rm_on_image_prompts(vlm_assets, tmp_path, capsys):
    rm = tmp_path / "rm"
    ok(cli(capsys, "train_rm", "--pretrain", str(vlm_assets.model_dir), "--dataset",
           str(vlm_assets.split("pref_train")),
           "--prompt_key", "prompt", "--actor.freeze_visual_encoder", "--packing_samples", "--save_path", str(rm),
           *COMMON))
    before, after = load_file(vlm_assets.model_dir / "model.safetensors"), load_file(rm / "model.safetensors")
    vision = [k for k in before if "visual" in k]
    assert vision and all(before[k].equal(after[k]) for k in vision)
    assert "score.weight" in after and sum(not before[k].equal(after[k]) for k in before if k not in vision) > 0
    assert (rm / "preprocessor_config.json").is_file() and steps(rm) >= 2
    # the RM scores PPO's image samples; the critic (a value head on --pretrain) sees the images too
    ppo = tmp_path / "ppo"
    ok(cli(capsys, "train_ppo", "--pretrain", str(vlm_assets.model_dir), "--reward_pretrain", str(rm), "--prompt_data",
           str(vlm_assets.split("rl_train")), "--input_key", "prompt", "--apply_chat_template", "--data.image_key",
           "images", "--advantage_estimator", "gae", "--rollout_batch_size", "4", "--train_batch_size", "4",
           "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4", "--generate_max_len", "8",
           "--prompt_max_len", "64", "--max_rl_steps", "2", "--save_path", str(ppo), "--disable_progress_bar"))
    records = [json.loads(line) for line in (ppo / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for r in records if "train/critic/value_loss" in r) == 2, records[-1]
