"""`reasoning_gym:<task>` data sources (rlhfkit/data/generated_tasks.py) and their packaged reward
(rlhfkit/rewards/reasoning_gym_reward.py), against reasoning-gym's own generator and scorer."""

from __future__ import annotations

import json

import pytest

from rlhfkit.data.readers import load_mixture, load_records
from rlhfkit.errors import UserError

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install reasoning-gym)")


def test_records_are_the_generator_s_problems_with_their_answers():
    from rlhfkit.data.generated_tasks import is_held_out

    records = load_records("reasoning_gym:basic_arithmetic?size=20&seed=3")
    stream = rg.create_dataset("basic_arithmetic", size=60, seed=3)
    direct = [e for e in (stream[i] for i in range(60)) if not is_held_out(e["question"])][:20]
    assert len(direct) == 20 < 60 - sum(is_held_out(stream[i]["question"]) for i in range(60))  # some were skipped
    assert [r["prompt"] for r in records] == [e["question"] for e in direct]
    assert [r["answer"] for r in records] == [str(e["answer"]) for e in direct]
    label = json.loads(records[0]["label"])
    assert label["task"] == "basic_arithmetic" and label["entry"]["answer"] == direct[0]["answer"]
    assert records[0].where() == "reasoning_gym:basic_arithmetic?size=20&seed=3@train: record 1"


def test_the_held_out_split_is_deterministic_and_shares_no_problem_with_train():
    spec = "reasoning_gym:basic_arithmetic?size=200&seed=1"
    train = {r["prompt"] for r in load_records(spec)}
    test = load_records(spec + "@test")
    assert len(test) == 200 and not train & {r["prompt"] for r in test}
    assert [r["prompt"] for r in load_records(spec + "@test")] == [r["prompt"] for r in test]


def test_no_test_draw_shares_a_question_with_any_train_draw_whatever_the_sizes_and_seeds():
    # Two-term sums of small numbers repeat questions across draws: a training split larger than the held-out one,
    # or drawn with another seed, used to hold some of the held-out questions (35 of 86 in one run).
    task = "reasoning_gym:chain_sum?min_terms=2&max_terms=2&min_digits=1&max_digits=2"
    train = {r["prompt"] for size, seed in [(1000, 1), (300, 7)]
             for r in load_records(f"{task}&size={size}&seed={seed}")}
    for size, seed in [(100, 1), (60, 7), (40, 3)]:
        test = [r["prompt"] for r in load_records(f"{task}&size={size}&seed={seed}@test")]
        assert len(test) == size and not train & set(test), (size, seed, sorted(train & set(test))[:3])
    assert len(load_records(f"{task}&size=1000&seed=1")) == 1000  # sizes are honoured on both sides


def test_the_question_partition_holds_out_a_fifth_of_questions():
    from rlhfkit.data.generated_tasks import HELD_OUT_SHARE, is_held_out

    questions = [f"What is {a} + {b}?" for a in range(40) for b in range(50)]
    share = sum(map(is_held_out, questions)) / len(questions)
    assert HELD_OUT_SHARE == 0.2 and abs(share - 0.2) < 0.03
    assert is_held_out(questions[0]) == is_held_out("What is 0 + 0?")  # a function of the text alone


def test_a_split_that_finds_no_question_on_its_side_is_one_line(monkeypatch):
    from rlhfkit.data import generated_tasks

    monkeypatch.setattr(generated_tasks, "is_held_out", lambda question: False)  # a task of training questions only
    with pytest.raises(UserError, match="none of the task's first 64 problems falls on the held-out side"):
        load_records("reasoning_gym:basic_arithmetic?size=1@test", arg_name="--eval_dataset")


def test_task_settings_pass_through_and_mix_with_other_sources():
    records = load_records("reasoning_gym:basic_arithmetic?size=8&min_terms=2&max_terms=2&seed=0")
    assert all(json.loads(r["label"])["entry"]["metadata"]["num_terms"] == 2 for r in records)
    mixed = load_mixture("reasoning_gym:basic_arithmetic?size=10,reasoning_gym:gsm_symbolic?size=10", "0.5,0.5",
                         max_samples=10)
    assert {json.loads(r["label"])["task"] for r in mixed} == {"basic_arithmetic", "gsm_symbolic"}


@pytest.mark.parametrize("spec, message", [
    ("reasoning_gym:", "names no task"),
    ("reasoning_gym:gsm_symbolik", "no task 'gsm_symbolik'; did you mean gsm_symbolic"),
    ("reasoning_gym:basic_arithmetic?size=0", "size=0 must be a positive integer"),
    ("reasoning_gym:basic_arithmetic?seed=x", "seed=x must be a non-negative integer"),
    ("reasoning_gym:basic_arithmetic?min_terms=9&max_terms=2", "refused the task's settings"),
    ("reasoning_gym:basic_arithmetic@dev2", "has the splits train and test"),
])
def test_bad_specs_are_one_line(spec, message):
    with pytest.raises(UserError, match=message) as e:
        load_records(spec, arg_name="--prompt_data")
    assert "\n" not in str(e.value) and str(e.value).startswith("--prompt_data")


def test_the_packaged_reward_scores_with_the_task_s_scorer():
    from rlhfkit.rewards.reasoning_gym_reward import answer_of, reward_func

    records = load_records("reasoning_gym:gsm_symbolic?size=3&seed=1")
    answer = records[0]["answer"]
    prompts = [r["prompt"] for r in records[:1]] * 4
    replies = [f" <answer>{answer}</answer>", f" so it is 7 then {answer}", " no idea", f" <answer>{answer}1</answer>"]
    out = reward_func([p + r for p, r in zip(prompts, replies)], prompts, [records[0]["label"]] * 4)
    entry = json.loads(records[0]["label"])["entry"]
    expected = [rg.get_score_answer_fn("gsm_symbolic")(answer_of(r, answer), entry) for r in replies]
    assert out["rewards"].tolist() == pytest.approx(expected)
    assert out["rewards"].tolist()[:2] == [1.0, 1.0] and out["rewards"][2] < 1 and out["rewards"][3] < 1
    assert answer_of("the sum is 12, then 40.", "40") == "40" and answer_of("<answer> red </answer>", "red") == "red"


def test_two_grpo_steps_on_a_generated_task_with_the_packaged_reward(demo_assets, tmp_path, capsys):
    from tests.helpers import run_here

    save = tmp_path / "out"
    proc = run_here([
        "rlhfkit.cli.train_ppo", "--pretrain", str(demo_assets.model_dir),
        "--prompt_data", "reasoning_gym:basic_arithmetic?size=8&max_terms=2&max_digits=1",
        "--input_key", "prompt", "--label_key", "label", "--remote_rm_url", "reasoning_gym",
        "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "4",
        "--micro_rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "4",
        "--max_samples", "8", "--generate_max_len", "6", "--prompt_max_len", "48", "--save_path", str(save),
        "--disable_progress_bar"], capsys)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if any(k.startswith("train/") for k in r)]
    assert len(steps) == 2
    logged = [r for r in rows if any("reasoning_gym_correct" in k for k in r)]
    assert logged, sorted(rows[-1])
