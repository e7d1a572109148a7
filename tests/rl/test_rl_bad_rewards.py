"""A reward function that raises, hangs, returns NaN or the wrong length, exits or segfaults costs samples, not the
run; above --max_reward_failure_ratio the run stops with one line and its last checkpoint resumes."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import run_here
from tests.rl.test_rl_estimators import ppo_args

# First-round calls (2 samples each, --micro_rollout_batch_size 2) are numbered across all worker processes (a
# marker file per call); each number has one behaviour, which the call's samples keep in the retries in halves (a
# file per sample records it), so each of them fails alone too. 4 first-round calls per step:
#   step 1 = calls 0-3: raise (2 samples), sleep past the timeout (2), NaN for its first sample (1), fine
#   step 2 = calls 4-7: wrong length (2), os._exit (2), segfault (2), fine
#   step 3 = calls 8-11: all raise -> 8 of 8 failed, more than the ratio 0.8
BAD_REWARD = """
import ctypes, hashlib, os, time

MARKERS = {markers!r}


def call_number():
    i = 0
    while True:
        try:
            os.close(os.open(os.path.join(MARKERS, str(i)), os.O_CREAT | os.O_EXCL))
            return i
        except FileExistsError:
            i += 1


def sample_file(query):
    return os.path.join(MARKERS, "q" + hashlib.sha256(query.encode()).hexdigest())


def behaviour(queries):
    if len(queries) == 2:
        n = call_number()
        for q in queries:
            with open(sample_file(q), "w") as f:
                f.write(str(n))
        return n
    known = [sample_file(q) for q in queries if os.path.exists(sample_file(q))]
    return int(open(known[0]).read()) if known else 7


def reward_func(queries, prompts, labels):
    n = behaviour(queries)
    if n == 0 or n >= 8:
        raise ValueError("boom on purpose")
    if n == 1:
        time.sleep(60)
    if n == 2:
        return [float("nan")] + [1.0] * (len(queries) - 1)
    if n == 4:
        return []
    if n == 5:
        os._exit(3)
    if n == 6:
        ctypes.string_at(0)
    return [1.0] * len(queries)
"""
GOOD_REWARD = "def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n"


def train_rows(save: Path) -> list[dict]:
    rows = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/reward" in r]


def test_bad_crash_and_timeout_rewards_cost_samples_then_the_ratio_stops_the_run(demo_assets, tmp_path, capsys):
    markers = tmp_path / "calls"
    markers.mkdir()
    bad = tmp_path / "bad_reward.py"
    bad.write_text(BAD_REWARD.format(markers=str(markers)))
    ckpt = tmp_path / "ckpt"
    common = ["--max_samples", "12", "--micro_rollout_batch_size", "2", "--save_steps", "1", "--ckpt_path",
              str(ckpt), "--max_ckpt_num", "5"]
    out = tmp_path / "run"
    proc = run_here(ppo_args(demo_assets, out, "reinforce", "--remote_rm_url", str(bad), *common,
                             "--reward_workers", "2", "--reward_timeout", "2", "--reward_fallback", "-1",
                             "--max_reward_failure_ratio", "0.8"), capsys)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rlhfkit.cli.train_ppo: error: reward function {bad}: reward_func raised ValueError: "
                           "boom on purpose; 8 of 8 samples failed this step (more than --max_reward_failure_ratio "
                           "0.8); e.g. query 0: 'User: "), last
    rows = train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    kinds = [{k.rsplit("/", 1)[1]: v for k, v in r.items() if "failure_kinds" in k} for r in rows]
    assert kinds == [{"exception": 2, "timeout": 2, "non_finite": 1}, {"wrong_length": 2, "crash": 4}]
    assert [r["train/reward/failures"] for r in rows] == [5, 6]
    assert [r["train/reward/retry_rounds"] for r in rows] == [1, 1]  # calls of 2: one round of retries in halves
    assert 2 <= rows[0]["train/reward/retry_seconds"] < 2 + 10  # the sleeping samples: one 2 s timeout
    # failed samples get the fallback -1, the others 1: (3 - 5) / 8 and (2 - 6) / 8
    assert [r["train/reward"] for r in rows] == [-0.25, -0.5]
    assert (ckpt / "latest").read_text() == "global_step2"

    resumed = tmp_path / "resumed"
    good = tmp_path / "good_reward.py"
    good.write_text(GOOD_REWARD)
    proc = run_here(ppo_args(demo_assets, resumed, "reinforce", "--remote_rm_url", str(good), *common,
                             "--load_checkpoint"), capsys)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = train_rows(resumed)
    assert [r["step"] for r in rows] == [3] and rows[0]["train/reward"] == 1.0
    assert rows[0]["train/reward/failures"] == 0
