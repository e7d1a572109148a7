"""`python -m rlhfkit.cli.train_dpo`: DPO / IPO / cDPO against a frozen reference (OpenRLHF's train_dpo flags)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import run_cli, run_config
from rlhfkit.config.preference import DPOConfig

PROG = "rlhfkit.cli.train_dpo"


def main(argv: Sequence[str] | None = None) -> int:
    return run_config(DPOConfig, argv, PROG, __doc__, "rlhfkit.trainers.dpo:run_dpo")


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
