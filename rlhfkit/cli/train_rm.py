"""`python -m rlhfkit.cli.train_rm`: reward-model training on preference pairs (same flags as OpenRLHF's train_rm)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import run_cli, run_config
from rlhfkit.config.preference import RMConfig

PROG = "rlhfkit.cli.train_rm"


def main(argv: Sequence[str] | None = None) -> int:
    return run_config(RMConfig, argv, PROG, __doc__, "rlhfkit.trainers.reward:run_rm")


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
