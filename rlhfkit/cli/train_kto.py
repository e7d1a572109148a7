"""`python -m rlhfkit.cli.train_kto`: KTO on unpaired labelled completions (same flags as OpenRLHF's train_kto)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rlhfkit.cli.common import run_cli, run_config
from rlhfkit.config.preference import KTOConfig

PROG = "rlhfkit.cli.train_kto"


def main(argv: Sequence[str] | None = None) -> int:
    return run_config(KTOConfig, argv, PROG, __doc__, "rlhfkit.trainers.kto:run_kto")


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
