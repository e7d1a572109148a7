"""RL learns: 100 steps of GRPO, and of REINFORCE++-baseline, raise held-out exact-match on the demo addition task.

Setup (the measurement of the platform notes, ../shared/PLATFORM.md, through the real CLI): the SFT model of
`sft_model_dir`, 16 prompts x 8 samples per step, actor lr 1e-4, no KL, the rule-based exact-match reward of
examples/reward_func.py. Held-out: every addition prompt of the demo's rl_eval and sft_eval splits (disjoint from
training prompts by construction), greedy decoding. One evaluation swings by a few points, so the bar (+0.08) sits
well under the gain measured while writing this test (see the assertion messages for the numbers of a run).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers import REPO, run_here
from tests.sft_fixtures import TEMPLATE, addition_only, write_jsonl

MIN_GAIN = 0.08
MAX_SECONDS = 300
STEPS = 100


def exact_match(model_dir: Path, records: list[dict]) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.demo.evaluate import evaluate_exact_match

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return evaluate_exact_match(model, tokenizer, records, input_template=TEMPLATE).accuracy


@pytest.fixture(scope="module")
def addition_data(demo_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("addition")
    train = write_jsonl(root / "train.jsonl", addition_only(demo_assets.read("rl_train")))
    held_out = addition_only(demo_assets.read("rl_eval")) + \
        addition_only(demo_assets.read("sft_eval"), question="question", answer="response")
    return train, held_out


@pytest.fixture(scope="module")
def sft_exact_match(sft_model_dir, addition_data) -> float:
    return exact_match(sft_model_dir, addition_data[1])


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["group_norm", "reinforce_baseline"])
def test_rl_raises_held_out_exact_match(sft_model_dir, sft_exact_match, addition_data, tmp_path, estimator, capsys):
    train, held_out = addition_data
    save = tmp_path / "policy"
    started = time.perf_counter()
    proc = run_here([
        "rlhfkit.cli.train_ppo", "--pretrain", str(sft_model_dir), "--prompt_data", str(train),
        "--input_key", "prompt", "--label_key", "answer", "--input_template", TEMPLATE,
        "--remote_rm_url", str(REPO / "examples" / "reward_func.py"), "--advantage_estimator", estimator,
        "--rollout_batch_size", "16", "--n_samples_per_prompt", "8", "--train_batch_size", "128",
        "--micro_train_batch_size", "64", "--micro_rollout_batch_size", "128", "--num_episodes", "2",
        "--max_rl_steps", str(STEPS), "--generate_max_len", "8", "--prompt_max_len", "64", "--temperature", "1.0",
        "--actor_learning_rate", "1e-4", "--lr_warmup_ratio", "0.03", "--init_kl_coef", "0", "--zero_stage", "0",
        "--seed", "0", "--save_path", str(save), "--disable_progress_bar"], capsys)
    seconds = time.perf_counter() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = exact_match(save, held_out)
    summary = (f"{estimator}: held-out exact-match {sft_exact_match:.3f} -> {after:.3f} "
               f"({len(held_out)} prompts) in {seconds:.0f} s")
    print(summary)
    assert after - sft_exact_match >= MIN_GAIN, summary
    assert seconds < MAX_SECONDS, summary
