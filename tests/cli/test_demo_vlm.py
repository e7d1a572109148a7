"""`rlhfkit demo --vlm` (rlhfkit/cli/demo_vlm.py): the commands it builds, and one reduced run of both stages."""

from __future__ import annotations

from pathlib import Path

from rlhfkit.cli.demo import main
from rlhfkit.cli.demo_vlm import _parse, eval_argv, grpo_argv, sft_argv
from rlhfkit.config.base import parse_config
from rlhfkit.config.batch_inference import BatchInferenceConfig
from rlhfkit.config.rl import PPOConfig
from rlhfkit.config.sft import SFTConfig


def test_the_stages_commands_parse_and_carry_the_images():
    args = _parse(["--grpo_prompts", "4", "--grpo_samples", "2", "--grpo_steps", "3"])
    sft = parse_config(SFTConfig, sft_argv(Path("m"), Path("d.jsonl"), Path("s"), 25, 0), "x")
    grpo = parse_config(PPOConfig, grpo_argv(Path("s"), Path("p.jsonl"), Path("g"), args), "x")
    ev = parse_config(BatchInferenceConfig, eval_argv("g", Path("e.jsonl"), Path("o.jsonl")), "x")
    assert sft.vision.image_key == grpo.vision.image_key == ev.data.image_key == "images"
    assert grpo.vision.freeze_visual_encoder and grpo.rollout.vllm_num_engines == 0
    assert (grpo.rollout.rollout_batch_size, grpo.rollout.n_samples_per_prompt) == (4, 2)
    assert ev.generation.greedy_sampling and ev.scoring.remote_rm_url.endswith("reward_func.py")


def test_vlm_demo_runs_both_stages_reduced(tmp_path, capsys):
    code = main(["--vlm", "--out", str(tmp_path), "--sft_steps", "2", "--grpo_steps", "1", "--grpo_prompts", "4",
                 "--grpo_samples", "2", "--n_eval", "8", "--n_train", "64"])
    out = capsys.readouterr().out
    assert code == 0
    for stage in ("before SFT", "after SFT", "after GRPO"):
        assert f"held-out image exact-match {stage}" in out
    assert "| GRPO from the SFT model" in (tmp_path / "report.md").read_text()
