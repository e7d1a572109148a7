"""Dataclass configs turned into flat OpenRLHF-style flags.

A CLI config is a dataclass whose fields are either plain options or nested dataclasses (sections). Every plain
field becomes one flag named after the field (`--zero_stage`), so the nested grouping is for the code and the
`--help` output only; field names are unique across a config. A YAML or JSON file given with `--config` supplies
defaults (flat keys, or nested by section), and flags on the command line override it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rlhfkit.errors import UserError

T = TypeVar("T")


def arg(default: Any = None, help: str = "", *, choices: Sequence[Any] | None = None,
        aliases: Sequence[str] = (), factory: Any = None) -> Any:
    """A config field with its CLI help text, allowed values and alternative flag names."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "aliases": tuple(aliases)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_fields(cls: type, section: str = "") -> Iterator[tuple[str, str, dataclasses.Field, Any]]:
    """Yield (section, name, field, type) for every plain option of a config class, depth first."""
    hints = _resolved_hints(cls)
    for f in dataclasses.fields(cls):
        ftype = hints[f.name]
        if dataclasses.is_dataclass(ftype):
            yield from iter_fields(ftype, f.name)
        else:
            yield section, f.name, f, ftype


def _base_type(ftype: Any) -> Any:
    """`int | None` -> int; `list[str] | None` -> list[str]."""
    args = [a for a in typing.get_args(ftype) if a is not type(None)]
    if typing.get_origin(ftype) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        return args[0]
    return ftype


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) instead of a usage dump."""

    def error(self, message: str) -> typing.NoReturn:  # noqa: D102
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


def build_parser(cls: type, prog: str, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with one flag per option of `cls`, grouped by section."""
    parser = _Parser(prog=prog, description=description, allow_abbrev=False,
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="YAML or JSON file with option values; flags on the command line override it")
    groups: dict[str, Any] = {}
    for section, name, f, ftype in iter_fields(cls):
        group = groups.setdefault(section, parser.add_argument_group(section or "options"))
        meta = f.metadata
        flags = [f"--{name}", *[f"--{a}" for a in meta.get("aliases", ())]]
        kwargs: dict[str, Any] = {"dest": name, "help": meta.get("help", ""), "default": argparse.SUPPRESS}
        base = _base_type(ftype)
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if _default_of(f) else "store_true"
        elif typing.get_origin(base) is list:
            (item,) = typing.get_args(base)
            kwargs.update(nargs="+", type=item)
        else:
            kwargs["type"] = base
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
        group.add_argument(*flags, **kwargs)
    return parser


def _read_config_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config {path}: file not found")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error is the user's file
        raise UserError(f"--config {path}: cannot parse ({e.__class__.__name__}: {e})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of option names to values")
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):  # a section
            flat.update({k.replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key.replace("-", "_")] = value
    return flat


def _construct(cls: type[T], values: dict[str, Any]) -> T:
    hints = _resolved_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        ftype = hints[f.name]
        if dataclasses.is_dataclass(ftype):
            kwargs[f.name] = _construct(ftype, values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def parse_config(cls: type[T], argv: Sequence[str] | None, prog: str, description: str = "") -> T:
    """Parse flags (and an optional `--config` file) into an instance of `cls`."""
    parser = build_parser(cls, prog, description)
    ns = vars(parser.parse_args(argv))
    values: dict[str, Any] = {}
    config_path = ns.pop("config", None)
    if config_path:
        known = {name for _, name, _, _ in iter_fields(cls)}
        file_values = _read_config_file(config_path)
        unknown = sorted(set(file_values) - known)
        if unknown:
            raise UserError(f"--config {config_path}: unknown option(s) {', '.join(unknown)}")
        values.update(file_values)
    values.update(ns)
    return _construct(cls, values)


def flag_table(cls: type) -> str:
    """A Markdown table of every flag of `cls` (used to write and check the README)."""
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for _, name, f, _ in iter_fields(cls):
        default = _default_of(f)
        aliases = "".join(f", `--{a}`" for a in f.metadata.get("aliases", ()))
        choices = f.metadata.get("choices")
        text = f.metadata.get("help", "")
        if choices:
            text += f" One of: {', '.join(map(str, choices))}."
        rows.append(f"| `--{name}`{aliases} | `{default}` | {text} |")
    return "\n".join(rows)
