"""`python -m rlhfkit.cli.train_dpo`: DPO / IPO / cDPO against a frozen reference (OpenRLHF's train_dpo flags)."""

from __future__ import annotations

import sys

from rlhfkit.cli.common import cli_main, run_cli
from rlhfkit.config.preference import DPOConfig

PROG = "rlhfkit.cli.train_dpo"

main = cli_main(DPOConfig, PROG, __doc__, "rlhfkit.trainers.dpo:run_dpo",
               plan_as="dpo", validate=DPOConfig.check_inputs)  # parsing validates the flags


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
