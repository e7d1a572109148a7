"""examples/dapo_recipe.sh end to end at tiny size (2 DAPO steps through train_ppo_ray on the untrained demo model):
it prints the held-out exact-match before and after, and the run logged the recipe's dynamic filtering and overlong
shaping. The learning figure is a bench (bench/results/dapo_recipe.md), not this test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

from tests.helpers import REPO


def test_dapo_recipe_runs_two_steps(demo_assets, tmp_path):
    # The untrained model answers nothing right: every group scores 0, so the range (-1, 1) keeps them (the default
    # (0, 1) would, rightly, find no group with a learning signal).
    assets = tmp_path / "assets"  # a copy: the script writes the addition splits into the ASSETS it is given, and
    shutil.copytree(demo_assets.root, assets)  # the session's demo_assets are compared with a fresh build elsewhere
    env = {**os.environ, "PYTHON": sys.executable, "ASSETS": str(assets), "WORK": str(tmp_path),
           "SFT_MODEL": str(demo_assets.model_dir), "STEPS": "2", "PROMPTS_PER_STEP": "2", "SAMPLES_PER_PROMPT": "2",
           "FILTER_RANGE": "-1 1", "HELDOUT": "8", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", str(REPO / "examples" / "dapo_recipe.sh")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.search(r"^held-out exact-match \(8 prompts\): SFT ([\d.]+) -> DAPO ([\d.]+)$", proc.stdout, re.M)
    assert found, proc.stdout
    assert all(0 <= float(x) <= 1 for x in found.groups())
    rows = [json.loads(x) for x in (tmp_path / "dapo" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/reward" in r]
    assert [r["step"] for r in train] == [1, 2]
    for row in train:
        assert row["train/dynamic_filtering/rounds"] == 1 and row["train/dynamic_filtering/pass_rate"] == 1
        assert "train/shaping/overlong_penalty" in row and "train/actor/clip_fraction" in row
        assert "train/kl" in row and row["train/kl_coef"] == 0
    assert (tmp_path / "dapo" / "config.json").is_file()
