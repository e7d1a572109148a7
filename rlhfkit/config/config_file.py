"""A `--config` file (YAML or JSON): its keys mapped onto the command's fields, and its values converted as the same
flag on the command line converts its text.

A value in the file is the flag's value, so it goes through the flag's own parser action: the flag's type
(`learning_rate: 1e-3`, a string for a YAML 1.1 reader, is the float 0.001 as `--learning_rate 1e-3` is), its
choices (`zero_stage: 7` fails as `--zero_stage 7` does), its arity (`adam_betas: 0.9` is the list [0.9], as
`--adam_betas 0.9` gives, and `validate` refuses it for the same reason). A boolean flag takes true or false (YAML's
booleans, or the strings "true" / "false": `bf16: "false"` is False, never a truthy string), and only a boolean flag
takes a YAML boolean (`use_wandb: false` would be the text "False"); null is allowed only where the flag's default
is None. Every error names the file and the key: `--config run.yaml: zero_stage: invalid choice 7 (choose from 0,
1, 2, 3)`. A rule of `validate` broken by a file value says so too (`name_file_in_error`).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhfkit.config import openrlhf_names as theirs
from rlhfkit.errors import UserError

_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def read_config_file(path: str) -> dict[str, Any]:
    """The file's options as {dotted key: value}: nested mappings become dotted keys (`actor: {adam: {lr: x}}`
    -> `actor.adam.lr`), dashes become underscores."""
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

    def walk(prefix: str, mapping: dict[str, Any]) -> None:
        for key, value in mapping.items():
            name = prefix + str(key).replace("-", "_")
            if isinstance(value, dict):
                walk(name + ".", value)
            else:
                flat[name] = value

    walk("", data)
    return flat


def resolve_file_keys(fields: frozenset[str], sections: set[str], file_values: dict[str, Any],
                      path: str) -> tuple[dict[str, str], dict[str, Any]]:
    """({field: the file's key for it}, {OpenRLHF value-adapted flag: value}); fail on any other key.

    A key is one of our fields (`zero_stage`), OpenRLHF's name for one (`ds.zero_stage`), one of our fields under
    its section (`strategy.zero_stage`), or an adapted OpenRLHF flag (`actor.eps_clip_low_high: [0.2, 0.28]`)."""
    keys: dict[str, str] = {}
    adapted: dict[str, Any] = {}
    unknown = []
    for key, value in file_values.items():
        section, _, rest = key.partition(".")
        target = key if key in fields else theirs.alias_target(key, fields)
        if target is None and section in sections and rest in fields:
            target = rest
        if target is not None:
            keys[target] = key
        elif theirs.adapted_for(key, fields) is not None:
            adapted[key] = value
        elif theirs.not_supported_reason(key, fields):
            raise UserError(f"--config {path}: {key} is not supported yet by rlhfkit "
                            f"({theirs.not_supported_reason(key, fields)})")
        else:
            unknown.append(key)
    if unknown:
        raise UserError(f"--config {path}: unknown option(s) {', '.join(sorted(unknown))}")
    return keys, adapted


def convert_file_values(parser: argparse.ArgumentParser, keys: dict[str, str], file_values: dict[str, Any],
                        defaults: dict[str, Any], path: str) -> dict[str, Any]:
    """{field: value} of the file, each value converted by the action of its flag in `parser`; `keys` maps each
    field to the file's key, `defaults` each field to its default (None there allows null)."""
    actions = {a.dest: a for a in parser._actions}
    values = {}
    for name, key in keys.items():
        try:
            values[name] = _convert(actions[name], file_values[key], nullable=defaults.get(name) is None)
        except ValueError as e:
            raise UserError(f"--config {path}: {key}: {e}") from None
    return values


def convert_adapted(adapted: dict[str, Any], fields: frozenset[str], path: str) -> dict[str, Any]:
    """The file's OpenRLHF value-adapted flags with each value (or list item) converted to the flag's kind."""
    converted = {}
    for flag, value in adapted.items():
        a = theirs.adapted_for(flag, fields)
        assert a is not None
        try:
            items = value if isinstance(value, list) else [value]
            kinds = [_typed(a.kind, item) for item in items]
        except ValueError as e:
            raise UserError(f"--config {path}: {flag}: {e}") from None
        converted[flag] = kinds if isinstance(value, list) else kinds[0]
    return converted


def _convert(action: argparse.Action, value: Any, nullable: bool) -> Any:
    """`value` as `action` would store its flag's command-line text; ValueError says why not."""
    if value is None:
        if nullable:
            return None
        raise ValueError("needs a value (null is not allowed here)")
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        return _as_bool(value)
    if action.nargs == "+":
        items = value if isinstance(value, list) else [value]
        if not items:
            raise ValueError("needs at least one value")
        return [_checked(action, item) for item in items]
    return _checked(action, value)


def _checked(action: argparse.Action, value: Any) -> Any:
    typed = _typed(action.type, value)  # type: ignore[arg-type]
    if action.choices is not None and typed not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"invalid choice {value!r} (choose from {choices})")
    return typed


def _typed(kind: Callable[[str], Any] | None, value: Any) -> Any:
    if isinstance(value, (list, dict)):
        raise ValueError(f"expected one value, got {value!r}")
    if isinstance(value, bool):  # no flag text is a boolean; str(False) would be a truthy "False" (`--use_wandb`)
        raise ValueError(f"expected {'a number' if kind in (int, float) else 'text'}, got the YAML boolean "
                         f"{str(value).lower()} (quote it if it is text)")
    if kind is None:
        return str(value)
    try:
        return kind(str(value))
    except (TypeError, ValueError):
        raise ValueError(f"invalid {getattr(kind, '__name__', 'value')} value {value!r}") from None


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if isinstance(value, (str, int)) and text in _TRUE + _FALSE:
        return text in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")


def name_file_in_error(error: UserError, keys: dict[str, str], path: str) -> UserError:
    """`error` (a flag rule broken), naming the file and key when a flag it names got its value from the file."""
    message = str(error)
    for flag in re.findall(r"--(\w+)", message):
        if flag in keys:
            return UserError(f"{message} (from --config {path}, key {keys[flag]})")
    return error
