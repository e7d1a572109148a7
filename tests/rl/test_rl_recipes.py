"""The recipes of 2025 through the RL loop (train_ppo, one process, tiny demo model, 2 steps each):
DAPO's dynamic sampling with a scripted reward, overlong and stop-properly shaping, GSPO with the icepop
correction, the actor's EMA as the exported model and the best-by-eval export, all in one run (one subprocess)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers import run_here
from tests.rl.test_rl_estimators import assert_finite, check, ppo_args, train_metrics, weights

# Scored by the label: group "solved" (every sample 1), "failed" (every sample 0) or "mixed" (samples 0, 1, 0, 1...
# counted over the run, so the 2 adjacent samples of a group score 0 and 1). Every scored sample is logged.
SCRIPTED_REWARD = """
import json

import torch

LOG = {log!r}
_count = [0]


def kind(label):
    return ("solved", "failed", "mixed")[sum(map(ord, str(label))) % 3]


def reward_func(queries, prompts, labels):
    if all(str(label).startswith("EVAL") for label in labels):  # held-out prompts: 1 for a response with "1"
        return {{"rewards": torch.tensor([float("1" in q[len(p):]) for q, p in zip(queries, prompts)])}}
    scores = []
    for label in labels:
        k = kind(label)
        scores.append(1.0 if k == "solved" else 0.0 if k == "failed" else float(_count[0] % 2))
        _count[0] += 1
    with open(LOG, "a") as f:
        for label, score in zip(labels, scores):
            f.write(json.dumps({{"kind": kind(label), "score": score}}) + "\\n")
    t = torch.tensor(scores)
    return {{"rewards": t, "scores": t}}
"""


def scripted_reward(tmp_path: Path) -> tuple[str, Path]:
    log = tmp_path / "scored.jsonl"
    path = tmp_path / "scripted_reward.py"
    path.write_text(SCRIPTED_REWARD.format(log=str(log)))
    return str(path), log


def test_recipe_flags_through_the_loop(demo_assets, tmp_path, capsys):
    """Dynamic filtering drops exactly the all-equal groups and refills the batch; shaping, GSPO, icepop act; the
    EMA is what --save_path exports; --best_metric_key keeps the best evaluated policy in <save_path>/best."""
    reward, log = scripted_reward(tmp_path)
    save = tmp_path / "out"
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({**r, "answer": f"EVAL{r['answer']}"}) + "\n"
                                for r in demo_assets.read("rl_eval")[:6]))
    check(run_here(ppo_args(demo_assets, save, "group_norm", "--remote_rm_url", reward, "--rollout_batch_size",
                            "2", "--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_samples",
                            "48", "--max_rl_steps", "2", "--dynamic_filtering", "--dynamic_filtering_reward_range",
                            "0", "1", "--policy_loss_type", "gspo", "--enable_vllm_is_correction",
                            "--vllm_is_correction_type", "icepop", "--vllm_is_truncated_threshold", "0.5", "5",
                            "--overlong_buffer_len", "4", "--overlong_penalty_factor", "0.5",
                            "--stop_properly_penalty_coef", "0.5", "--init_kl_coef", "0", "--enable_ema",
                            "--ema_beta", "0.999", "--eval_dataset", str(held_out), "--eval_steps", "1",
                            "--eval_temperature", "0", "--best_metric_key", "eval/reward"), capsys))
    rows = train_metrics(save)
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite(rows)
    # Replay the scored groups (2 samples each, 2 groups per generation round): a step takes rounds until 2 mixed
    # groups were seen; its pass rate is mixed / all groups scored in those rounds.
    groups = [json.loads(x)["kind"] for x in log.read_text().splitlines()][::2]
    expected, pos = [], 0
    for _ in range(2):
        rounds = mixed = seen = 0
        while mixed < 2:
            batch = groups[pos: pos + 2]
            pos += 2
            rounds += 1
            seen += 2
            mixed += batch.count("mixed")
        expected.append((rounds, mixed / seen))
    assert pos == len(groups)  # nothing scored beyond what the two steps needed
    assert sorted(set(groups)) == ["failed", "mixed", "solved"]  # the data exercised the filter
    assert any(r > 1 for r, _ in expected)  # and the refill
    for row, (rounds, pass_rate) in zip(rows, expected):
        assert row["train/dynamic_filtering/rounds"] == rounds
        assert abs(row["train/dynamic_filtering/pass_rate"] - pass_rate) < 1e-9
        # only mixed groups (scores 0 and 1) were trained on: the kept batch's raw rewards are 0, 1, 0, 1
        assert row["train/reward"] == 0.5 and row["train/reward_std"] == 0.5
        assert row["train/shaping/overlong_penalty"] <= 0 and row["train/shaping/stop_properly_penalty"] <= 0
        assert 0 <= row["train/actor/is_masked_fraction"] <= 1

    initial, exported = weights(demo_assets.model_dir), weights(save)
    # Adam at lr 1e-3 moves the trained weights by ~1e-3 a step; the EMA with beta 0.999 moves ~1000x less.
    change = max((exported[k].float() - v.float()).abs().max().item() for k, v in initial.items())
    assert 0 < change < 2e-5
    evals = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines() if "eval/reward" in x]
    assert [e["step"] for e in evals] == [1, 2]
    best = json.loads((save / "best" / "best_metric.json").read_text())
    top = max(e["eval/reward"] for e in evals)
    assert best == {"metric": "eval/reward", "value": top,
                    "step": next(e["step"] for e in evals if e["eval/reward"] == top)}
    best_weights = weights(save / "best")
    assert set(best_weights) == set(initial)
    assert torch.isfinite(torch.cat([t.flatten().float() for t in best_weights.values()])).all()
