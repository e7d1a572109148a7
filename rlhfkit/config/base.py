"""Dataclass configs turned into flat OpenRLHF-style flags.

A CLI config is a dataclass whose fields are either plain options or nested dataclasses (sections). Every plain
field becomes one flag named after the field (`--zero_stage`), so the nested grouping is for the code and the
`--help` output only; field names are unique across a config. A YAML or JSON file given with `--config` supplies
defaults (flat keys, nested by section, or dotted), converted and checked as the same flags on the command line
(`rlhfkit.config.config_file`), and flags on the command line override it.

OpenRLHF's other spellings (`--actor.model_name_or_path`, `--eps_clip_low_high LO HI`, ...; the table is
`rlhfkit.config.openrlhf_names`) are accepted everywhere a flag is: as aliases on the command line (listed in
`--help`), as keys of a `--config` file, and in the flag tables of the docs site's command pages. Their flags
without an rlhfkit equivalent fail with "not supported yet" (one line, exit code 2).

`parse_config` ends with the config's `validate()`: each flag's checks live there, once (checks that need the
inputs themselves, such as required paths and files, are the config's `check_inputs()`, run by the trainer).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from rlhfkit.config import config_file
from rlhfkit.config import openrlhf_names as theirs
from rlhfkit.config.devices import resolve_device_defaults
from rlhfkit.errors import UserError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

# A config class: parse_config and _construct build dataclasses only.
T = TypeVar("T", bound="DataclassInstance")
V = TypeVar("V")


def arg(default: Any = None, help: str = "", *, choices: Sequence[Any] | None = None,
        aliases: Sequence[str] = (), factory: Any = None) -> Any:
    """A config field with its CLI help text, allowed values and alternative flag names."""
    meta = {"help": help, "choices": tuple(choices) if choices else None, "aliases": tuple(aliases)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def with_default(section: type, name: str, default: Any) -> Any:
    """Field `name` of the config section `section` with another default and the same help, choices and
    aliases: a command's own default in a subclass of a shared section (train_rm's learning rate)."""
    meta = section.__dataclass_fields__[name].metadata  # type: ignore[attr-defined]
    factory = (lambda: list(default)) if isinstance(default, list) else None
    return arg(default, meta["help"], choices=meta["choices"], aliases=meta["aliases"], factory=factory)


def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def iter_fields(cls: type, section: str = "") -> Iterator[tuple[str, str, dataclasses.Field, Any]]:
    """Yield (section, name, field, type) for every plain option of a config class, depth first."""
    hints = _resolved_hints(cls)
    for f in dataclasses.fields(cls):
        ftype = hints[f.name]
        if isinstance(ftype, type) and dataclasses.is_dataclass(ftype):
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
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def field_defaults(cls: type) -> dict[str, Any]:
    """{field: default} of every option of the config class `cls`."""
    return {name: _default_of(f) for _, name, f, _ in iter_fields(cls)}


def field_values(cfg: Any) -> dict[str, Any]:
    """{field: value} of every option of the config `cfg`, its sections' included."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            values.update(field_values(value))
        else:
            values[f.name] = value
    return values


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) instead of a usage dump, and negative numbers as values."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # argparse takes `-1e-3`, `-inf` or `-.5e2` for an option (only `-1` and `-1.5` look numeric to it), so
        # `--learning_rate -1e-3` failed with "expected one argument" instead of being parsed and range-checked.
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$",
                                                   re.IGNORECASE)

    def error(self, message: str) -> typing.NoReturn:  # noqa: D102
        unknown = message.partition("unrecognized arguments:")[2].split()
        if any(t.startswith("--") and "." in t for t in unknown):
            # a dotted flag missing from the alias table: point at the table of the ones rlhfkit knows
            message += "; OpenRLHF's dotted flags that rlhfkit accepts are listed in docs/migration.md"
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(2)


_ADAPTED_DEST = "openrlhf:"
SEED_LIMIT = 2**32


class _NotSupported(argparse.Action):
    """An OpenRLHF flag rlhfkit has no equivalent for yet: fail with its reason instead of "unrecognized"."""

    reason = ""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: D102
        raise UserError(f"{option_string} is not supported yet by rlhfkit ({self.reason})")


def field_names(cls: type) -> frozenset[str]:
    return frozenset(name for _, name, _, _ in iter_fields(cls))


def build_parser(cls: type, prog: str, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with one flag per option of `cls`, grouped by section, plus OpenRLHF's spellings."""
    parser = _Parser(prog=prog, description=description, allow_abbrev=False,
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None,
                        help="YAML or JSON file of flag values (flat keys, by section, or OpenRLHF's names), each "
                             "converted and checked as the same flag on the command line; flags given there "
                             "override it")
    fields = field_names(cls)
    groups: dict[str, Any] = {}
    for section, name, f, ftype in iter_fields(cls):
        group = groups.setdefault(section, parser.add_argument_group(section or "options"))
        meta = f.metadata
        openrlhf = [flag for flag in theirs.ALIASES if theirs.alias_target(flag, fields) == name]
        flags = [f"--{name}", *[f"--{a}" for a in meta.get("aliases", ())], *[f"--{a}" for a in openrlhf]]
        kwargs: dict[str, Any] = {"dest": name, "help": meta.get("help", ""), "default": argparse.SUPPRESS}
        base = _base_type(ftype)
        if base is bool:
            # OpenRLHF's boolean spellings are store_true flags: keep ours store_true whenever they alias one.
            kwargs["action"] = argparse.BooleanOptionalAction if _default_of(f) and not openrlhf else "store_true"
        elif typing.get_origin(base) is list:
            (item,) = typing.get_args(base)
            kwargs.update(nargs="+", type=item)
        else:
            kwargs["type"] = base
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
        group.add_argument(*flags, **kwargs)
    taken = set(parser._option_string_actions)
    adapted = parser.add_argument_group("OpenRLHF flags with another value shape")
    for a in theirs.ADAPTED:
        if f"--{a.flag}" not in taken and theirs.alias_target(a.flag, fields) is None and a.applies(fields):
            adapted.add_argument(f"--{a.flag}", dest=_ADAPTED_DEST + a.flag, type=a.kind, nargs=a.nargs,
                                 metavar=a.metavar, help=a.help, default=argparse.SUPPRESS)
            taken.add(f"--{a.flag}")
    unsupported = parser.add_argument_group("OpenRLHF flags not supported yet (each fails with its reason)")
    for flag in sorted({*theirs.NOT_SUPPORTED, *theirs.ALIASES, *(a.flag for a in theirs.ADAPTED)}):
        reason = theirs.not_supported_reason(flag, fields)
        if reason and f"--{flag}" not in taken:
            # Listed in --help when OpenRLHF has it and rlhfkit does not yet; another command's flag (train_sft
            # given --data.prompt_dataset) still fails with its reason but does not clutter this command's help.
            action = unsupported.add_argument(f"--{flag}", action=_NotSupported, nargs="*", metavar="...",
                                              help=reason, default=argparse.SUPPRESS)
            assert isinstance(action, _NotSupported)
            action.reason = reason
            if flag not in theirs.NOT_SUPPORTED:
                action.help = argparse.SUPPRESS
    return parser


def _apply_adapted(cls: type, values: dict[str, Any], adapted: dict[str, Any],
                   context: dict[str, Any] | None = None) -> None:
    """Turn OpenRLHF flags of another value shape into our fields of `values` (after the plain values are known).

    A field that `values` already sets explicitly must agree; `context` holds values set elsewhere (the config
    file, under command-line flags) that a relative flag like `--data.max_len` reads."""
    fields = field_names(cls)
    defaults = {name: _default_of(f) for _, name, f, _ in iter_fields(cls)}
    known = {**defaults, **(context or {}), **values}
    explicit = set(values)
    for flag, value in adapted.items():
        a = theirs.adapted_for(flag, fields)
        assert a is not None
        if a.nargs not in (None, "?") and not isinstance(value, list):
            value = [value]
        if isinstance(a.nargs, int) and len(value) != a.nargs:
            raise UserError(f"--{flag} takes {a.nargs} values (got {value})")
        for name, new in a.convert(value, known.get).items():
            if name in explicit and values[name] != new:
                raise UserError(f"--{flag} and --{name} both set {name} ({new} vs {values[name]}); pass one")
            values[name] = known[name] = new


def _construct(cls: type[T], values: dict[str, Any]) -> T:
    hints = _resolved_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        ftype = hints[f.name]
        if isinstance(ftype, type) and dataclasses.is_dataclass(ftype):
            kwargs[f.name] = _construct(ftype, values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def _file_values(cls: type, parser: argparse.ArgumentParser, path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """({field: value} of the `--config` file, converted as the flags are; {field: the file's key})."""
    fields = field_names(cls)
    sections = {section for section, _, _, _ in iter_fields(cls) if section}
    raw = config_file.read_config_file(path)
    keys, adapted = config_file.resolve_file_keys(fields, sections, raw, path)
    values = config_file.convert_file_values(parser, keys, raw, field_defaults(cls), path)
    _apply_adapted(cls, values, config_file.convert_adapted(adapted, fields, path))
    return values, keys


def parse_config(cls: type[T], argv: Sequence[str] | None, prog: str, description: str = "") -> T:
    """Parse flags (and an optional `--config` file, which they override) into an instance of `cls`."""
    return parse_config_given(cls, argv, prog, description)[0]


def parse_config_given(cls: type[T], argv: Sequence[str] | None, prog: str,
                       description: str = "") -> tuple[T, frozenset[str]]:
    """`parse_config`, and the fields the command gave (a flag in any spelling, or a `--config` file key): the
    rest are defaults, which `rlhfkit.config.openrlhf_defaults.startup_notes` compares with OpenRLHF's.

    Device-dependent defaults ("auto": bf16, the attention kernel) are resolved after validation, so --help, flag
    and validation errors answer without importing torch (`rlhfkit.config.devices`)."""
    parser = build_parser(cls, prog, description)
    ns = vars(parser.parse_args(argv))
    config_path = ns.pop("config", None)
    file_values, file_keys = _file_values(cls, parser, config_path) if config_path else ({}, {})
    adapted = {key[len(_ADAPTED_DEST):]: ns.pop(key) for key in [k for k in ns if k.startswith(_ADAPTED_DEST)]}
    _apply_adapted(cls, ns, adapted, context=file_values)
    cfg = _construct(cls, {**file_values, **ns})
    try:
        validate(cfg)
        refuse_inert_flags(cfg, frozenset(file_values) | frozenset(ns))
    except UserError as e:  # a rule broken by a value of the file names the file and its key
        raise config_file.name_file_in_error(e, {k: v for k, v in file_keys.items() if k not in ns},
                                             str(config_path)) from None
    given = frozenset(file_values) | frozenset(ns)
    from rlhfkit.config.backend import check_backend  # the rules that read which flags were given

    check_backend(cfg, given)
    resolve_device_defaults(cfg, given)
    return cfg, given


def required(value: V | None, flag: str) -> V:
    """The value of a flag that the config's checks (`validate`, `check_inputs`) require, typed without None.
    None here means those checks were skipped: a UserError naming the flag."""
    if value is None:
        raise UserError(f"--{flag} is required")
    return value


def validate(cfg: Any) -> None:
    """Every flag rule of a parsed config, before any model loads: `cfg.validate()` (which runs its sections'
    and adds the rules that join them), or the sections' alone for a config class without one; and every command's
    `--seed` in range."""
    seed = field_values(cfg).get("seed")
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        # numpy, Python's random and the engines' per-sample seeds all take it: beyond 2^32 some overflow
        raise UserError(f"--seed {seed} is out of range: use an integer in [0, 2^32 - 1]")
    if hasattr(cfg, "validate"):
        cfg.validate()
    else:
        validate_sections(cfg)


def refuse_inert_flags(cfg: Any, given: frozenset[str]) -> None:
    """One rule for every flag that cannot act in the layout the other flags give (vLLM flags with no vLLM engine,
    colocation of a role the run does not have): the config's `inert_flags()` says which and why, and a flag the
    command gave (`given`: on the command line or in the config file) among them stops the run (UserError). A
    default is never refused, so a flag's default value may be inert."""
    inert = getattr(cfg, "inert_flags", None)
    for name, why in (inert() if inert is not None else {}).items():
        if name in given:
            raise UserError(f"--{name} {why}")


def validate_sections(cfg: Any) -> None:
    """Call `validate()` of every nested section of `cfg`, depth first: the rules of each section's own flags
    (a UserError names the flag, its value and the allowed range)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate_sections(value)
            if hasattr(value, "validate"):
                value.validate()


def flag_table(cls: type) -> str:
    """A Markdown table of every flag of `cls`, with OpenRLHF's spellings (the docs site's command pages)."""
    fields = field_names(cls)
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for _, name, f, _ in iter_fields(cls):
        default = _default_of(f)
        aliases = "".join(f", `--{a}`" for a in f.metadata.get("aliases", ()))
        aliases += "".join(f", `--{a}`" for a in theirs.openrlhf_flags_of(name, fields))
        choices = f.metadata.get("choices")
        text = f.metadata.get("help", "")
        if choices:
            text += f" One of: {', '.join(map(str, choices))}."
        rows.append(f"| `--{name}`{aliases} | `{default}` | {text} |")
    return "\n".join(rows)
