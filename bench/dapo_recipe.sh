#!/usr/bin/env bash
# Bench of the DAPO recipe (examples/dapo_recipe.sh at its defaults): SFT on the demo addition task, then 100 DAPO
# steps through train_ppo_ray; prints the machine, the versions and the held-out exact-match before and after.
# Results: bench/results/dapo_recipe.md.   Usage: PYTHON=.venv/bin/python bash bench/dapo_recipe.sh
set -euo pipefail
PYTHON=${PYTHON:-python}
cd "$(dirname "$0")/.."
"$PYTHON" - <<'PY'
import os, platform
from importlib.metadata import version
names = ["torch", "transformers", "deepspeed", "ray"]
print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}")
print("versions: " + ", ".join(f"{n} {version(n)}" for n in names))
PY
start=$(date +%s)
PYTHON=$PYTHON WORK=${WORK:-./dapo_recipe_bench} bash examples/dapo_recipe.sh
echo "wall time: $(( $(date +%s) - start )) s"
