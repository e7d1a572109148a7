"""`rlhfkit report RUN_DIR`: (re)write the self-contained HTML report of a run directory.

Trainers write `<save_path>/report.html` when they finish; this command writes it on demand, e.g. for a run
that is still going or one copied from a cluster (it needs only the run directory's metrics.jsonl and, when
present, rlhfkit_args.json, rlhfkit_env.json and samples.jsonl).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rlhfkit.cli.common import run_cli
from rlhfkit.errors import UserError


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlhfkit report", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", help="a run directory (a trainer's --save_path) holding metrics.jsonl")
    p.add_argument("--metrics_path", default=None, help="metrics JSONL file (default: RUN_DIR/metrics.jsonl)")
    p.add_argument("--out", default=None, help="where to write the HTML (default: RUN_DIR/report.html)")
    args = p.parse_args(argv)
    from rlhfkit.logging.html_report import write_report

    run = Path(args.run_dir)
    metrics = Path(args.metrics_path) if args.metrics_path else run / "metrics.jsonl"
    if not run.is_dir():
        raise UserError(f"{args.run_dir}: not a directory; pass a run directory (a trainer's --save_path)")
    if not metrics.is_file():
        raise UserError(f"{metrics}: no metrics file; pass the run directory a trainer wrote, or --metrics_path")
    out = write_report(run, metrics, args.out)
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog="rlhfkit report"))
