"""What the command line offers, derived from `rlhfkit.cli.main.COMMANDS`: each command's module, its config class
and its flag parser.

The docs site (one page per command), the Docker entrypoint test and the SkyPilot test read the commands from here,
so a command registered in `main.COMMANDS` shows up in all three without another list to keep in step.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from rlhfkit.cli.main import COMMANDS


@dataclass(frozen=True)
class Command:
    """One `rlhfkit <name>` command: `python -m rlhfkit.cli.<module>`."""

    name: str
    module: str
    summary: str

    @property
    def module_path(self) -> str:
        return f"rlhfkit.cli.{self.module}"

    def load(self) -> ModuleType:
        return importlib.import_module(self.module_path)


def commands() -> list[Command]:
    """Every registered command whose module exists, in the order of `main.COMMANDS` (what `rlhfkit --help` lists;
    a command registered ahead of its module appears once the module lands)."""
    return [Command(name, module, summary) for name, (module, summary) in COMMANDS.items()
            if importlib.util.find_spec(f"rlhfkit.cli.{module}") is not None]


def by_module(module: str) -> Command | None:
    """The command run by `python -m rlhfkit.cli.<module>` (None when no command is registered for it)."""
    return next((c for c in commands() if c.module == module), None)


def config_class(command: Command) -> type | None:
    """The config dataclass the command parses its flags into (None for commands with a hand-written parser).

    The flag-table registry (`rlhfkit.config.docs.TABLES`) names it for the commands it lists; for the others
    (train_ppo_ray and serve_rm share or own theirs) it is the one config dataclass the CLI module imports from
    `rlhfkit.config`, so a new CLI needs no registration beyond `main.COMMANDS`.
    """
    from rlhfkit.config import docs

    spec = getattr(docs, "TABLES", {}).get(command.name)
    cls = docs.load_config_class(spec) if spec else None
    if cls is not None:
        return cls
    module = command.load()
    found = {id(v): v for v in vars(module).values()
             if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__.startswith("rlhfkit.config")}
    if len(found) > 1:
        names = ", ".join(sorted(c.__name__ for c in found.values()))
        raise ValueError(f"{command.module_path} imports several config classes ({names}); cannot tell which it parses")
    return next(iter(found.values()), None)


class _ParserFound(BaseException):  # not Exception: a CLI's `except Exception` around its parse must not catch it
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


@contextlib.contextmanager
def _stop_at_first_parse() -> Iterator[None]:
    """Make the first `parse_args`/`parse_known_args` call raise with its parser instead of parsing."""
    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def grab(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _ParserFound(self)

    argparse.ArgumentParser.parse_args = grab  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = grab  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved  # type: ignore[method-assign]


def parser_of(command: Command) -> argparse.ArgumentParser | None:
    """The argparse parser the command builds (None when it parses its arguments some other way).

    Config-class commands get `build_parser(config)`. For the others the command's `main` is entered and stopped at
    its first argument parse, so nothing past parsing runs; a `main` that finishes without parsing returns None.
    """
    from rlhfkit.config.base import build_parser

    cls = config_class(command)
    if cls is not None:
        return build_parser(cls, command.module_path)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            with _stop_at_first_parse():
                command.load().main([])
        except _ParserFound as found:
            return found.parser
        except (Exception, SystemExit):  # noqa: BLE001 - a main that fails before parsing has no parser to show
            return None
    return None


def parse_flags(command: Command, argv: Sequence[str]) -> Any:
    """Parse `argv` exactly as the command would (a config instance, or an argparse Namespace); raises SystemExit(2)
    on an unknown flag or a bad value, like the command itself."""
    from rlhfkit.config.base import parse_config

    cls = config_class(command)
    if cls is not None:
        return parse_config(cls, list(argv), command.module_path)
    parser = parser_of(command)
    if parser is None:
        raise ValueError(f"{command.module_path} has no argparse parser to check flags with")
    return parser.parse_args(list(argv))


def main() -> int:
    """`python -m rlhfkit.cli.catalog`: the command names, one a line (the Docker entrypoint's `list`)."""
    print("\n".join(c.name for c in commands()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
