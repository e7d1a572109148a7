"""`python -m rlhfkit.cli.train_sft`: supervised fine-tuning (same flags as OpenRLHF's train_sft)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import dry_run, quiet_libraries, run_cli
from rlhfkit.config.base import parse_config
from rlhfkit.config.sft import SFTConfig, validate_sft_config

PROG = "rlhfkit.cli.train_sft"


def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    cfg = parse_config(SFTConfig, argv, PROG, __doc__)
    if cfg.plan.dry_run:  # the trainer validates again; a dry run must fail on the same mistakes
        validate_sft_config(cfg)
    if dry_run(cfg, "sft", PROG):
        return 0
    from rlhfkit.trainers.sft import run_sft

    run_sft(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
