"""`python -m rlhfkit.cli.train_rm`: reward-model training on preference pairs (same flags as OpenRLHF's train_rm)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import dry_run, quiet_libraries, run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.preference import RMConfig, validate_rm_config

PROG = "rlhfkit.cli.train_rm"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    cfg = parse_config(RMConfig, argv, PROG, __doc__)
    if cfg.plan.dry_run:  # the trainer validates again; a dry run must fail on the same mistakes
        validate_rm_config(cfg)
    if dry_run(cfg, "rm", PROG):
        return 0
    from rlhfkit.trainers.reward import run_rm

    run_rm(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
