"""What every entry point shares: user errors as one line with exit code 2, quiet library logs, and the body of
the training and inference entry points (`run_config`)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from rlhfkit.errors import ComponentFailed, Preempted, UserError


def quiet_libraries() -> None:
    """Keep the console for our progress bar and errors: silence chatty library loggers (warnings stay visible)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from rlhfkit.distributed.launch import default_ds_accelerator

    default_ds_accelerator()
    for name in ("DeepSpeed", "deepspeed", "torch.distributed", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None,
            prog: str = "rlhfkit") -> int:
    """Run `main`; a UserError becomes one line on stderr (rank 0 only) and exit code 2; a preempted run (SIGTERM,
    checkpoint saved) says how to resume and exits 0."""
    try:
        code = main(argv)
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{prog}: error: {e}\n")
        return UserError.exit_code
    except ComponentFailed as e:
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{prog}: error: {e}\n")
        return ComponentFailed.exit_code
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{prog}: {e}\n")
        return Preempted.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    return int(code or 0)


def run_config(config_cls: type, argv: Sequence[str] | None, prog: str, doc: str | None, runner: str,
               validate: Callable[[Any], Any] | None = None) -> int:
    """The body of an entry point that parses flags into a config and runs one trainer: quiet the libraries, parse
    `argv` into `config_cls` (`--help` shows `doc`), `validate` it, then import `runner` ("module:function", imported
    only now so that --help and flag errors answer without loading torch) and call it with the config."""
    from rlhfkit.config.base import parse_config

    quiet_libraries()
    cfg = parse_config(config_cls, argv, prog, doc)
    if validate is not None:
        validate(cfg)
    module, _, function = runner.partition(":")
    getattr(importlib.import_module(module), function)(cfg)
    return 0
