"""rlhfkit's wheel installs with `[dev]` into a clean venv, where `rlhfkit --help` and one SFT step run (issue 24,
acceptance 4).

"Clean" here: a new venv (`python -m venv --without-pip`) that holds nothing of the repository: no editable
install, no PYTHONPATH, run from a directory outside the repository, so `import rlhfkit` can only find the
installed wheel (the test asserts where it came from). Offline: the venv's site-packages gets one .pth line to this
venv's site-packages, which stands for the dependencies PyPI would supply (pip sees them as installed, at the
versions of the lock), and pip installs with `--no-index`: every requirement of rlhfkit and of `[dev]` must be met
by them, or the install fails. The wheel is built from a copy of the sources with `pip wheel --no-deps
--no-build-isolation` (setuptools from this venv, no network), so the source tree gets no build/ or egg-info.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "rlhfkit", src / "rlhfkit", ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"),
         str(src)], cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("rlhfkit-*.whl")
    return wheel


def clean_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = venv / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path)
    (Path(site.stdout.strip()) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_wheel_installs_with_dev_and_runs_help_and_one_sft_step(demo_assets, tmp_path):
    wheel = build_wheel(tmp_path)
    venv = clean_venv(tmp_path)
    python = str(venv / "bin" / "python")
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index", f"{wheel}[dev]"],
        cwd=tmp_path)
    where = run([python, "-c", "import rlhfkit; print(rlhfkit.__file__)"], cwd=tmp_path).stdout
    assert where.startswith(str(venv)), where
    assert "train_sft" in run([str(venv / "bin" / "rlhfkit"), "--help"], cwd=tmp_path).stdout
    save = tmp_path / "save"
    run([str(venv / "bin" / "rlhfkit"), "train_sft", "--pretrain", str(demo_assets.model_dir),
         "--dataset", str(demo_assets.sft_train), "--input_key", "question", "--output_key", "response",
         "--input_template", "User: {}\nAssistant: ", "--train_batch_size", "4", "--micro_train_batch_size", "4",
         "--max_len", "48", "--max_samples", "4", "--max_steps", "1", "--logging_steps", "1",
         "--disable_progress_bar", "--save_path", str(save), "--ckpt_path", str(tmp_path / "ckpt")], cwd=tmp_path)
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1]
