"""A 2-rank job (run as `python -m tests.distributed.absent_peer <ddp_timeout> <joined_file>`, one process per rank)
whose rank 1 joins the process group and then never arrives at the collective rank 0 waits in."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def main(argv: list[str] | None) -> int:
    import os

    import torch
    import torch.distributed as dist

    from rlhfkit.config.common import StrategyArgs
    from rlhfkit.distributed.strategy import DeepSpeedStrategy

    timeout, joined = float(argv[0]), Path(argv[1])
    args = StrategyArgs(train_batch_size=2, micro_train_batch_size=1, ddp_timeout=timeout)
    args.validate()
    DeepSpeedStrategy(args).setup_distributed()  # the trainers' path to init_process_group
    if os.environ["RANK"] == "1":
        joined.write_text("1")
        time.sleep(300)  # stuck (the test kills it): never reaches the all_reduce
        return 0
    dist.all_reduce(torch.ones(4))
    return 0


if __name__ == "__main__":
    from rlhfkit.cli.common import run_cli

    sys.exit(run_cli(main, sys.argv[1:], prog="absent_peer"))
