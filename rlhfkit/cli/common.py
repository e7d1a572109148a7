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
    checkpoint saved) says how to resume and exits 0; a failed part of the run (ComponentFailed) is one line and exit
    code 1, and so is a collective past --ddp_timeout, said by the rank that waited (any rank may be the one whose
    peer is gone)."""
    try:
        code = main(argv)
    except UserError as e:
        cause = getattr(e, "cause", None)  # raised in a Ray actor: Ray's wrapper's text holds the remote traceback
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{prog}: error: {cause if isinstance(cause, UserError) else e}\n")
        return UserError.exit_code
    except ComponentFailed as e:
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{prog}: error: {e}\n")
        return ComponentFailed.exit_code
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":
            sys.stderr.write(f"{prog}: {e}\n")
        return Preempted.exit_code
    except RuntimeError as e:
        from rlhfkit.distributed.launch import collective_timeout_message, leave_process_group

        message = collective_timeout_message(e)
        if message is None:
            raise
        sys.stderr.write(f"{prog}: error: rank {os.environ.get('RANK', '0')}: {message}\n")
        leave_process_group()
        return ComponentFailed.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"{prog}: interrupted\n")
        return 130
    if _leave_launched_group():
        # and skip the interpreter's C++ teardown, where a rank of a finished run still aborted (SIGABRT) in CI
        # with the group left: a successful run exits with its code. Everything the run wrote is closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(int(code or 0))
    return int(code or 0)


def _leave_launched_group() -> bool:
    """A finished run launched over several ranks (torchrun, deepspeed) leaves its process group before the
    interpreter exits: left to exit, gloo's worker threads are destroyed unjoined and a rank can abort (SIGABRT,
    "terminate called without an active exception") after the run succeeded, which failed a 4-rank CI run once. A
    world of one (a test or a notebook calling this in-process) keeps its group. True when it left one."""
    dist = sys.modules.get("torch.distributed")  # never imported: no group to leave (and no torch import for --help)
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from rlhfkit.distributed.launch import leave_process_group

        leave_process_group()
        return True
    return False


def note_openrlhf_defaults(prog: str, cfg: Any, given: frozenset[str]) -> None:
    """On rank 0, one stderr line per default this run takes where OpenRLHF 0.11 has another (a flag not given;
    `rlhfkit.config.openrlhf_defaults.startup_notes`): a pasted OpenRLHF command says what it relies on."""
    from rlhfkit.config.openrlhf_defaults import startup_notes

    if os.environ.get("RANK", "0") != "0":
        return
    for line in startup_notes(prog.rpartition(".")[2], cfg, given):
        sys.stderr.write(line + "\n")


def use_converted_gguf(cfg: Any) -> None:
    """`--pretrain model.gguf` (or `--pretrain DIR --gguf_file NAME`): convert the file once (cached) and point
    `--pretrain` at the Hugging Face directory, so every consumer after this (trainer, reference, engines, Ray
    actors, the memory plan) loads that directory and the engines serve the weights the trainer trains."""
    model = getattr(cfg, "model", None)
    if model is None or not hasattr(model, "gguf_file"):
        return
    from rlhfkit.models.gguf import resolve_pretrain

    model.pretrain = resolve_pretrain(model.pretrain, model.gguf_file)
    model.gguf_file = None


def cli_main(config_cls: type, prog: str, doc: str | None, runner: str, *, plan_as: str | None = None,
             validate: Callable[[Any], Any] | None = None,
             validate_always: bool = False) -> Callable[[Sequence[str] | None], int]:
    """The `main(argv)` of an entry point that parses flags into a config and runs one trainer (`run_config`)."""

    def main(argv: Sequence[str] | None = None) -> int:
        return run_config(config_cls, argv, prog, doc, runner, plan_as=plan_as, validate=validate,
                          validate_always=validate_always)

    return main


def run_config(config_cls: type, argv: Sequence[str] | None, prog: str, doc: str | None, runner: str, *,
               plan_as: str | None = None, validate: Callable[[Any], Any] | None = None,
               validate_always: bool = False) -> int:
    """The body of an entry point that parses flags into a config and runs one trainer: quiet the libraries, parse
    `argv` into `config_cls` (`--help` shows `doc`); with --dry_run (trainers that plan memory: `plan_as` is sft, rm,
    dpo, kto, ppo or ppo_ray) `validate` it (the trainer validates again; a dry run must fail on the same mistakes;
    `validate_always`: also without --dry_run), print the memory plan and stop (`dry_run`); otherwise import `runner`
    ("module:function", imported only now so that --help and flag errors answer without loading torch) and call it
    with the config."""
    from rlhfkit.config.base import parse_config_given

    quiet_libraries()
    cfg: Any
    cfg, given = parse_config_given(config_cls, argv, prog, doc or "")
    note_openrlhf_defaults(prog, cfg, given)
    use_converted_gguf(cfg)
    planning = plan_as is not None and cfg.plan.dry_run
    if validate is not None and (validate_always or planning):
        validate(cfg)
    if plan_as is not None and planning:
        from rlhfkit.planner.dry_run import dry_run

        dry_run(cfg, plan_as, prog)
        return 0
    module, _, function = runner.partition(":")
    getattr(importlib.import_module(module), function)(cfg)
    return 0
