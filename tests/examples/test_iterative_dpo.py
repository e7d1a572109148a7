"""examples/iterative_dpo.sh runs two rounds end to end on the demo assets (tiny sizes) and prints the held-out
preference accuracy of each round; every round's DPO pairs have chosen reward > rejected reward."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.helpers import REPO


def test_two_rounds_print_heldout_accuracy(demo_assets, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "ASSETS": str(demo_assets.root), "WORK": str(tmp_path),
           "ROUNDS": "2", "N_PROMPTS": "6", "BEST_OF_N": "3", "MAX_NEW_TOKENS": "5", "RM_PAIRS": "32",
           "EVAL_PAIRS": "16", "DPO_BATCH": "3", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", str(REPO / "examples" / "iterative_dpo.sh")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rounds = re.findall(r"^round (\d): sample reward mean (-?[\d.]+)\s+held-out preference accuracy ([\d.]+)$",
                        proc.stdout, re.M)
    assert [r[0] for r in rounds] == ["1", "2"], proc.stdout
    for round_, mean, accuracy in rounds:
        assert 0.0 <= float(accuracy) <= 1.0
        pairs = [json.loads(line) for line in (tmp_path / f"round{round_}" / "pairs.jsonl").read_text().splitlines()]
        assert pairs and all(p["chosen_reward"] > p["rejected_reward"] for p in pairs)
        # round r generated for its own slice of prompts (--iter r-1, --rollout_batch_size 6)
        r = int(round_)
        assert {p["prompt"] for p in pairs} <= {x["prompt"] for x in demo_assets.read("rl_train")[(r - 1) * 6:r * 6]}
        # the printed sample mean is the reward model's mean over the round's samples, which bracket the pairs
        assert min(p["rejected_reward"] for p in pairs) <= float(mean) <= max(p["chosen_reward"] for p in pairs)
    # round 2 generated from round 1's policy, and a final policy was saved
    assert (tmp_path / "round2" / "policy" / "config.json").is_file()
    assert "final policy:" in proc.stdout
