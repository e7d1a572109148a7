"""`python -m rlhfkit.cli.train_kto`: KTO on unpaired labelled completions (same flags as OpenRLHF's train_kto)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import dry_run, quiet_libraries, run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.preference import KTOConfig, validate_kto_config

PROG = "rlhfkit.cli.train_kto"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    cfg = parse_config(KTOConfig, argv, PROG, __doc__)
    if cfg.plan.dry_run:  # the trainer validates again; a dry run must fail on the same mistakes
        validate_kto_config(cfg)
    if dry_run(cfg, "kto", PROG):
        return 0
    from rlhfkit.trainers.kto import run_kto

    run_kto(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
