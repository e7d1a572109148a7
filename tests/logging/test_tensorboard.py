"""`--use_tensorboard DIR`: the event files, read back with TensorBoard's own reader, hold every metric of
metrics.jsonl with the same value at the same step (non-finite values included: TensorBoard stores NaN and inf)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rlhfkit.config.common import LoggingArgs
from rlhfkit.logging.metrics import MetricsLogger
from tests.helpers import run_here


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = [p for p in log_dir.rglob("events.out.tfevents.*")]
    assert len(runs) == 1, runs
    acc = EventAccumulator(str(runs[0].parent), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def jsonl_scalars(path: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key not in ("step", "time"):
                out.setdefault(key, {})[record["step"]] = value
    return out


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=0.0)  # float32 events


def assert_same(tb: dict[str, dict[int, float]], js: dict[str, dict[int, float]]) -> None:
    assert set(tb) == set(js)
    for key in js:
        assert set(tb[key]) == set(js[key]), key
        assert all(same(tb[key][s], js[key][s]) for s in js[key]), (key, tb[key], js[key])


def test_logger_writes_every_metric_to_tensorboard(tmp_path):
    args = LoggingArgs(use_tensorboard=str(tmp_path / "tb"))
    logger = MetricsLogger(args, str(tmp_path / "run"), "unit", config={})
    for step in range(1, 4):
        logger.log(step, {"loss": 1.0 / step, "lr": 1e-4 * step, "grad_norm": float("nan") if step == 2 else 0.5})
    logger.log(3, {"loss": 0.25}, prefix="eval")
    logger.close()
    tb, js = tensorboard_scalars(tmp_path / "tb"), jsonl_scalars(tmp_path / "run" / "metrics.jsonl")
    assert "train/grad_norm" in tb and math.isnan(tb["train/grad_norm"][2])
    assert_same(tb, js)


def test_sft_run_with_use_tensorboard(demo_assets, tmp_path, capsys):
    save = tmp_path / "sft"
    proc = run_here(["rlhfkit.cli.train_sft", "--pretrain", str(demo_assets.model_dir), "--dataset",
                     str(demo_assets.sft_train), "--input_key", "question", "--output_key", "response",
                     "--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_len", "48",
                     "--max_samples", "12", "--max_epochs", "1", "--save_path", str(save),
                     "--use_tensorboard", str(tmp_path / "tb"), "--disable_progress_bar"], capsys)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tb, js = tensorboard_scalars(tmp_path / "tb"), jsonl_scalars(save / "metrics.jsonl")
    assert "train/loss" in js and len(js["train/loss"]) == 3
    assert_same(tb, js)
