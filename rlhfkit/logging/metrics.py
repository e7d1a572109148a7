"""Metrics sinks: a JSONL file always, TensorBoard and Weights & Biases on request, and a console progress bar.

Only rank 0 writes. Every record carries `step` and a wall-clock `time`. The run directory also gets the
environment (`rlhfkit_env.json`) at the start, sample rollouts (`samples.jsonl`) when a trainer logs them, and
the HTML run report (`report.html`, rlhfkit.logging.html_report) when the logger closes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from rlhfkit.config.common import LoggingArgs
from rlhfkit.config.serving import WANDB_WORDS
from rlhfkit.logging import html_report


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, (int, float)):
            out[k] = float(v)
    return out


def records_through(lines: list[str], step: int) -> list[str]:
    """The lines of a JSONL metrics (or samples) file a run resumed at `step` keeps: records of steps up to `step`.
    Later records belong to steps the killed run finished but did not checkpoint; the resumed run writes them
    again. A line cut by a kill is dropped too (the next record would be appended to it)."""
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)) or record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def _rewrite_through(path: Path, step: int) -> None:
    """`records_through` in place, atomically (a kill leaves the old file or the new one)."""
    if not path.is_file():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = records_through(lines, step)
    if kept == lines:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


class MetricsLogger:
    """Fan-out of metric dicts to every enabled sink."""

    def __init__(self, args: LoggingArgs, run_dir: str, run_name: str, config: dict[str, Any],
                 enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = Path(args.metrics_path or os.path.join(run_dir, "metrics.jsonl"))
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / html_report.ENV_NAME).write_text(
            json.dumps(html_report.capture_environment(), indent=1, default=str))
        self._file = self.path.open("a")
        if args.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=os.path.join(args.use_tensorboard, run_name))
        if args.use_wandb:
            self._wandb = _start_wandb(args, args.use_wandb, run_name, config, run_dir)

    def log(self, step: int, metrics: dict[str, Any], prefix: str = "train") -> None:
        if not self.enabled:
            return
        values = _clean(metrics)
        if self._file is None:
            raise RuntimeError("MetricsLogger.log() after close()")
        record = {"step": step, "time": time.time(), **{f"{prefix}/{k}": v for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:  # every value, NaN and inf too: the event files mirror the JSONL
            for k, v in values.items():
                self._tb.add_scalar(f"{prefix}/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({f"{prefix}/{k}": v for k, v in values.items()}, step=step)

    def resumed_at(self, step: int) -> None:
        """A resumed run continues after `step`: drop the records of later steps (written by the interrupted run
        after its last checkpoint) from the metrics and samples files, so each step has one row."""
        if self._file is None:
            return
        self._file.close()
        _rewrite_through(self.path, step)
        _rewrite_through(self.run_dir / html_report.SAMPLES_NAME, step)
        self._file = self.path.open("a")

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A few rollouts (prompt, response, reward) for the run report's table."""
        if not self.enabled or not rows:
            return
        with (self.run_dir / html_report.SAMPLES_NAME).open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}, default=str) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
            try:
                html_report.write_report(self.run_dir, self.path)
            except Exception as e:  # noqa: BLE001 - a report must never hide the run's own outcome
                sys.stderr.write(f"rlhfkit: could not write the run report in {self.run_dir}: "
                                 f"{e.__class__.__name__}: {e}\n")
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _start_wandb(args: LoggingArgs, key: str, run_name: str, config: dict[str, Any], run_dir: str) -> Any:
    """`key` is --use_wandb: an API key, "offline", or true/1/yes to use the login already on the machine."""
    import wandb

    if key.lower() == "offline":
        os.environ["WANDB_MODE"] = "offline"
    elif key.lower() not in WANDB_WORDS and os.environ.get("WANDB_MODE") != "offline":
        wandb.login(key=key, relogin=True)
    return wandb.init(entity=args.wandb_org, project=args.wandb_project, group=args.wandb_group,
                      name=args.wandb_run_name or run_name, config=config, dir=run_dir, reinit="finish_previous")


class Progress:
    """A tqdm bar over optimizer steps showing loss, lr and tokens/s; tqdm provides the ETA."""

    def __init__(self, total: int, initial: int, desc: str, enabled: bool):
        self.bar = tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True,
                        unit="step")

    def update(self, postfix: dict[str, Any]) -> None:
        self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                             refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
