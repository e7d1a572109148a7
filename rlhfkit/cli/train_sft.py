"""`python -m rlhfkit.cli.train_sft`: supervised fine-tuning (same flags as OpenRLHF's train_sft)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import run_cli, run_config
from rlhfkit.config.sft import SFTConfig

PROG = "rlhfkit.cli.train_sft"


def main(argv: Sequence[str] | None = None) -> int:
    return run_config(SFTConfig, argv, PROG, __doc__, "rlhfkit.trainers.sft:run_sft")


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
