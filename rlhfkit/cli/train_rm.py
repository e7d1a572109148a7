"""`python -m rlhfkit.cli.train_rm`: reward-model training on preference pairs (same flags as OpenRLHF's train_rm)."""

from __future__ import annotations

import sys

from rlhfkit.cli.common import cli_main, run_cli
from rlhfkit.config.preference import RMConfig

PROG = "rlhfkit.cli.train_rm"

main = cli_main(RMConfig, PROG, __doc__, "rlhfkit.trainers.reward:run_rm",
               plan_as="rm", validate=RMConfig.check_inputs)  # parsing validates the flags


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
