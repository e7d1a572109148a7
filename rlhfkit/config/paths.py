"""Outputs are never inputs: the path rules every command's `check_inputs` runs before any work.

An output path (a model directory, a checkpoint directory, a JSONL file) is refused when it is one of the command's
inputs (`batch_inference --output_path` = `--dataset` would replace the prompts with the samples; `lora_combiner
--output_path` = `--model_path` would overwrite the base model), when it lies inside an input directory (the next
read of that directory would take the output for data or weights), and when a regular file stands where one of its
directories must be (`--save_path notes.txt/model` used to fail with a traceback after the whole run). The writers
themselves write aside and rename into place (`rlhfkit.models.publish`, `write_jsonl_atomic`), so a crash never
leaves half an output either.

The rules read the fields by name over every section of a config (`field_values`): one table for every command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhfkit.config.base import field_values
from rlhfkit.errors import UserError

# Fields whose value names something the command reads (a comma-separated list of paths for the data flags).
INPUT_FIELDS = ("pretrain", "ref_pretrain", "reward_pretrain", "critic_pretrain", "model_path", "lora_path",
                "dataset", "eval_dataset", "prompt_data", "remote_rm_url", "agent_func_path")
# Fields whose value names something the command writes, and whether it is a directory or a file.
OUTPUT_FIELDS = {"save_path": "dir", "ckpt_path": "dir", "use_tensorboard": "dir", "metrics_path": "file"}


def check_output_paths(cfg: Any, outputs: dict[str, str] | None = None) -> None:
    """UserError (one line, naming both flags) when an output path of `cfg` is an input, inside an input directory,
    or under a regular file. `outputs` ({field: "dir" | "file"}) replaces the default table (`OUTPUT_FIELDS`) for
    a command whose output field means something else (`output_path`: batch_inference's file, lora_combiner's
    model directory)."""
    values = field_values(cfg)
    inputs = [(name, p) for name in INPUT_FIELDS for p in _local_paths(values.get(name))]
    for name, kind in (outputs or OUTPUT_FIELDS).items():
        if values.get(name):
            _check_output(f"--{name}", str(values[name]), kind, inputs)


def check_not_under_a_file(path: str, flag: str) -> Path:
    """UserError when a regular file stands where the directory `path` or one of its ancestors must be. Returns
    the nearest existing ancestor (where the directory will be created). Creates nothing."""
    p = Path(path).expanduser().absolute()
    probe = p
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        where = "is" if probe == p else f"is under {probe}, which is"
        raise UserError(f"{flag} {path} {where} a file, not a directory; choose another {flag}")
    return probe


def _check_output(flag: str, path: str, kind: str, inputs: list[tuple[str, str]]) -> None:
    target = _resolved(path)
    if kind == "file" and target.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name such as {path}/out.jsonl")
    check_not_under_a_file(str(target.parent) if kind == "file" else path, flag)
    for name, source in inputs:
        src = _resolved(source)
        if target == src:
            raise UserError(f"{flag} {path} is also the input --{name} {source}: writing it would destroy the "
                            f"input; pick another {flag}")
        if src.is_dir() and target.is_relative_to(src):
            raise UserError(f"{flag} {path} lies inside the input --{name} {source}: the output would mix with "
                            f"what it reads; pick a {flag} outside it")


def _local_paths(value: Any) -> list[str]:
    """The local paths of an input flag: comma-separated, without an @split suffix, URLs left out."""
    if not value:
        return []
    paths = []
    for part in str(value).split(","):
        part = part.strip()
        if not part or "://" in part:
            continue
        if "@" in part and not Path(part).expanduser().exists():
            part = part.rsplit("@", 1)[0]
        paths.append(part)
    return paths


def _resolved(path: str) -> Path:
    return Path(path).expanduser().resolve()
