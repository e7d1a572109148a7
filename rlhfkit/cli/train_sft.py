"""`python -m rlhfkit.cli.train_sft`: supervised fine-tuning (same flags as OpenRLHF's train_sft)."""

from __future__ import annotations

import sys

from rlhfkit.cli.common import cli_main, run_cli
from rlhfkit.config.sft import SFTConfig

PROG = "rlhfkit.cli.train_sft"

main = cli_main(SFTConfig, PROG, __doc__, "rlhfkit.trainers.sft:run_sft",
               plan_as="sft")  # parsing validates the flags; a dry run needs no dataset


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
