"""`python -m rlhfkit.cli.train_kto`: KTO on unpaired labelled completions (same flags as OpenRLHF's train_kto)."""

from __future__ import annotations

import sys

from rlhfkit.cli.common import cli_main, run_cli
from rlhfkit.config.preference import KTOConfig

PROG = "rlhfkit.cli.train_kto"

main = cli_main(KTOConfig, PROG, __doc__, "rlhfkit.trainers.kto:run_kto",
               plan_as="kto", validate=KTOConfig.check_inputs)  # parsing validates the flags


if __name__ == "__main__":
    sys.exit(run_cli(main, prog=PROG))
