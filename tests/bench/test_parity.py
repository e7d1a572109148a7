"""bench/parity.py compare on hand-made run directories (no training): equal runs pass, a weight or loss past the
tolerance, a missing row or tensor, or a different sampled response fails; timing keys are ignored."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]


def parity():
    """bench/parity.py as a module (bench/ is scripts, not a package); registered before it runs, as dataclasses
    look their module up."""
    if "bench_parity" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_parity", ROOT / "bench" / "parity.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_parity"] = module
        spec.loader.exec_module(module)
    return sys.modules["bench_parity"]


def write_run(root: Path, loss: float = 0.5, weight: float = 1.0, rows: int = 2, response: str = "12",
              step_s: float = 0.1) -> Path:
    model = root / "grpo" / "model"
    model.mkdir(parents=True)
    lines = [{"step": i + 1, "time": 1e9 + i, "train/loss": loss, "train/time/step_s": step_s,
              "train/tokens_per_s": 100 * step_s} for i in range(rows)]
    (model / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (model / "samples.jsonl").write_text(json.dumps({"step": 1, "response": response, "reward": 1.0}) + "\n")
    save_file({"w": torch.full((2, 2), weight), "b": torch.zeros(2)}, str(model / "model.safetensors"))
    return root


def compare(tmp_path: Path, capsys, *extra: str, **new) -> tuple[int, str]:
    base, other = write_run(tmp_path / "base"), write_run(tmp_path / "new", **new)
    code = parity().main(["compare", str(base), str(other), *extra])
    return code, capsys.readouterr().out


def test_equal_runs_pass_and_timing_keys_are_ignored(tmp_path, capsys):
    code, out = compare(tmp_path, capsys, step_s=0.7)
    assert code == 0 and "PASS: 1 workloads" in out, out


def test_a_loss_past_the_tolerance_fails_and_below_it_passes(tmp_path, capsys):
    code, out = compare(tmp_path, capsys, loss=0.5 + 1e-4)
    assert code == 1 and "train/loss" in out and "metric diff above 1e-06" in out, out
    code = parity().main(["compare", str(tmp_path / "base"), str(tmp_path / "new"), "--tol", "1e-3"])
    assert code == 0


def test_a_weight_past_the_tolerance_fails(tmp_path, capsys):
    code, out = compare(tmp_path, capsys, weight=1.0 + 1e-5)
    assert code == 1 and "| w | FAIL |" in out, out


def test_a_missing_row_or_a_different_response_fails(tmp_path, capsys):
    code, out = compare(tmp_path, capsys, rows=1)
    assert code == 1 and "2 rows in base, 1 in new" in out, out
    code, out = compare(tmp_path / "again", capsys, response="13")
    assert code == 1 and "response differ" in out, out


def test_a_renamed_key_is_listed_and_mapped(tmp_path, capsys):
    base, new = write_run(tmp_path / "base"), write_run(tmp_path / "new")
    path = new / "grpo" / "model" / "metrics.jsonl"
    path.write_text(path.read_text().replace("train/loss", "train/actor_loss"))
    assert parity().main(["compare", str(base), str(new)]) == 0
    assert "only in base: train/loss" in capsys.readouterr().out
    assert parity().main(["compare", str(base), str(new), "--strict_keys"]) == 1
    assert parity().main(["compare", str(base), str(new), "--strict_keys", "--rename",
                          "train/loss=train/actor_loss"]) == 0
