"""The CPU plan against reality: run the real trainer a few steps in a subprocess, take its peak RSS (getrusage
RUSAGE_CHILDREN ru_maxrss of a wrapper that runs only that trainer), and compare with the --dry_run estimate for the
same flags. Two model sizes (the 1M-parameter demo model and a 27M-parameter random-init Llama) so the size-
dependent terms (weights, gradients, Adam states, the reference and engine copies, activations) must be right,
not only the constant per-process baseline."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from rlhfkit.cli import train_dpo, train_ppo, train_sft
from rlhfkit.cli.common import run_cli
from tests.helpers import REPO, run_module

TEMPLATE = "User: {}\nAssistant: "
REWARD = str(REPO / "tests" / "distributed" / "reward_exact_match.py")
MIB = 1024**2
WRAPPER = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
           "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, 'RC', code)")


@pytest.fixture(scope="module")
def llama_27m(demo_assets, tmp_path_factory):
    """A random-init Llama of 27.4M parameters (hidden 512, 8 layers, MLP 1376, untied) with the demo tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = json.loads((demo_assets.model_dir / "config.json").read_text())
    cfg = LlamaConfig(vocab_size=base["vocab_size"], hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=base["bos_token_id"],
                      eos_token_id=base["eos_token_id"], pad_token_id=base["pad_token_id"])
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("llama_27m")
    LlamaForCausalLM(cfg).save_pretrained(out)
    AutoTokenizer.from_pretrained(demo_assets.model_dir).save_pretrained(out)
    return out


def flags(trainer: str, assets, model: Path, save: Path) -> list[str]:
    common = ["--pretrain", str(model), "--input_template", TEMPLATE, "--train_batch_size", "8",
              "--micro_train_batch_size", "4", "--save_path", str(save), "--disable_progress_bar"]
    if trainer == "sft":
        return common + ["--dataset", str(assets.sft_train), "--input_key", "question", "--output_key", "response",
                         "--max_len", "48", "--max_steps", "3"]
    if trainer == "dpo":
        return common + ["--dataset", str(assets.pref_train), "--prompt_key", "prompt", "--max_len", "48",
                         "--max_steps", "3"]
    return common + ["--prompt_data", str(assets.rl_train), "--input_key", "prompt", "--label_key", "answer",
                     "--remote_rm_url", REWARD, "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
                     "--rollout_batch_size", "4", "--micro_rollout_batch_size", "4", "--max_samples", "8",
                     "--generate_max_len", "16", "--prompt_max_len", "32", "--max_rl_steps", "2"]


MAINS = {"sft": train_sft.main, "dpo": train_dpo.main, "ppo": train_ppo.main}


def estimate_mib(trainer: str, argv: list[str]) -> float:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert run_cli(MAINS[trainer], argv + ["--dry_run"], prog=trainer) == 0
    value, unit = re.search(r"estimated peak of all processes ([\d.]+) (MiB|GiB)", buf.getvalue()).groups()
    return float(value) * (1024 if unit == "GiB" else 1)


def measured_mib(trainer: str, argv: list[str]) -> float:
    proc = run_module([f"rlhfkit.cli.train_{trainer}", *argv], launcher=[sys.executable, "-c", WRAPPER,
                                                                          sys.executable, "-m"], timeout=600)
    match = re.search(r"PEAK_KIB (\d+) RC (-?\d+)", proc.stdout)
    assert match and match.group(2) == "0", proc.stdout[-2000:] + proc.stderr[-3000:]
    return int(match.group(1)) / 1024


@pytest.mark.parametrize("trainer", ["sft", "dpo", "ppo"])
def test_estimate_within_25_percent_of_peak_rss(trainer, demo_assets, llama_27m, tmp_path):
    results = {}
    for name, model in (("demo", demo_assets.model_dir), ("llama_27m", llama_27m)):
        argv = flags(trainer, demo_assets, model, tmp_path / name)
        results[name] = (estimate_mib(trainer, argv), measured_mib(trainer, argv))
    report = {k: f"estimate {e:.0f} MiB, measured {m:.0f} MiB" for k, (e, m) in results.items()}
    print(trainer, report)
    for estimate, measured in results.values():
        assert abs(estimate - measured) <= 0.25 * measured, report
    # the size-dependent part is real: the 27M model's extra memory over the demo model's is predicted within 25%
    (e_small, m_small), (e_big, m_big) = results["demo"], results["llama_27m"]
    assert abs((e_big - e_small) - (m_big - m_small)) <= 0.25 * (m_big - m_small), report


def test_wrapper_measures_only_its_child():
    proc = subprocess.run([sys.executable, "-c", WRAPPER, sys.executable, "-c", "x = bytearray(300 * 2**20)"],
                          capture_output=True, text=True, timeout=60)
    peak = int(re.search(r"PEAK_KIB (\d+)", proc.stdout).group(1)) / 1024
    assert 300 <= peak < 400
