"""lora_combiner: the merged model computes what base + adapter computes (causal LM and reward model with its value
head), and a mismatched adapter is one line with exit code 2."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.cli.common import run_cli
from rlhfkit.cli.lora_combiner import main


def _randomise_lora(model: torch.nn.Module, seed: int) -> None:
    """PEFT starts lora_B at zero (a no-op adapter): give every LoRA matrix (and the saved head) real values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _batch(model_dir) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(["User: What is 12+7?\nAssistant: 19", "User: Reverse abc\nAssistant: cba"], add_special_tokens=False,
              padding=True, return_tensors="pt")
    return ids["input_ids"], ids["attention_mask"]


def test_merged_causal_lm_equals_base_plus_adapter(demo_assets, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhfkit.models.lora import apply_lora

    base = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir, dtype=torch.float32)
    peft_model = apply_lora(base, rank=4, alpha=8, dropout=0.0, target_modules=None)
    _randomise_lora(peft_model, 0)
    peft_model.save_pretrained(tmp_path / "adapter")

    out = tmp_path / "merged"
    assert run_cli(main, ["--model_path", str(demo_assets.model_dir), "--lora_path", str(tmp_path / "adapter"),
                          "--output_path", str(out)]) == 0
    ids, mask = _batch(demo_assets.model_dir)
    fresh = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any("lora" in k for k in merged.state_dict())  # a plain model
    with torch.no_grad():
        expected = with_adapter(input_ids=ids, attention_mask=mask).logits
        got = merged(input_ids=ids, attention_mask=mask).logits
        plain = AutoModelForCausalLM.from_pretrained(demo_assets.model_dir)(input_ids=ids, attention_mask=mask).logits
    assert (expected - plain).abs().max() > 1e-2  # the adapter changes the outputs...
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)  # ...and the merge keeps the change


def test_merged_reward_model_keeps_the_adapter_head(demo_assets, tmp_path, capsys):
    from peft import PeftModel

    from rlhfkit.models.lora import apply_lora
    from rlhfkit.models.value_model import load_value_model, sequence_rewards

    torch.manual_seed(0)
    rm = apply_lora(load_value_model(str(demo_assets.model_dir), require_head=False), rank=4, alpha=8, dropout=0.0,
                    target_modules=None, head="score")
    _randomise_lora(rm, 1)
    rm.save_pretrained(tmp_path / "rm_adapter")  # what train_rm --lora_rank writes to <save_path>/lora_adapter

    # The adapter is a reward model's: without --is_rm it is refused in one line.
    args = ["--model_path", str(demo_assets.model_dir), "--lora_path", str(tmp_path / "rm_adapter"),
            "--output_path", str(tmp_path / "merged_rm")]
    capsys.readouterr()
    assert run_cli(main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass --is_rm" in err[0]

    assert run_cli(main, args + ["--is_rm"]) == 0
    ids, mask = _batch(demo_assets.model_dir)
    batch = {"input_ids": ids, "attention_mask": mask}
    torch.manual_seed(123)  # the base has no head: load_value_model draws one, which the adapter's head replaces
    with_adapter = PeftModel.from_pretrained(load_value_model(str(demo_assets.model_dir), require_head=False),
                                             tmp_path / "rm_adapter").eval()
    merged = load_value_model(str(tmp_path / "merged_rm")).eval()
    with torch.no_grad():
        expected = sequence_rewards(with_adapter, batch)
        got = sequence_rewards(merged, batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("args, message", [
    (["--model_path", "/nonexistent", "--lora_path", "x", "--output_path", "y"], "--model_path /nonexistent"),
    (["--lora_path", "x", "--output_path", "y"], "--model_path is required"),
])
def test_bad_input_is_one_line(args, message, capsys):
    assert run_cli(main, args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
