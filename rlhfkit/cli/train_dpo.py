"""`python -m rlhfkit.cli.train_dpo`: DPO / IPO / cDPO against a frozen reference (OpenRLHF's train_dpo flags)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import dry_run, quiet_libraries, run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.preference import DPOConfig, validate_dpo_config

PROG = "rlhfkit.cli.train_dpo"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    cfg = parse_config(DPOConfig, argv, PROG, __doc__)
    if cfg.plan.dry_run:  # the trainer validates again; a dry run must fail on the same mistakes
        validate_dpo_config(cfg)
    if dry_run(cfg, "dpo", PROG):
        return 0
    from rlhfkit.trainers.dpo import run_dpo

    run_dpo(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
