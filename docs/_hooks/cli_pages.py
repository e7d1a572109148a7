"""MkDocs hook: one page per rlhfkit command, generated at build time from the code.

The command list is `rlhfkit.cli.main.COMMANDS` (through `rlhfkit.cli.catalog`) and each flag table comes from the
command's config dataclass (`rlhfkit.config.base.flag_table`) or, for commands with a hand-written argparse
parser, from that parser. A command registered in main.py therefore gets its page, nav entry and flags with no edit
here. Also supplies a placeholder for docs/migration.md while that page is not written yet.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Document the checkout being built, not whatever rlhfkit is installed. Imported here, while the path is set:
# mkdocs restores sys.path once the hook module is loaded.
sys.path.insert(0, str(ROOT))
try:
    from rlhfkit.cli import catalog
    from rlhfkit.config.base import flag_table
finally:
    sys.path.remove(str(ROOT))

from mkdocs.structure.files import File  # noqa: E402

NAV_KEY = "Commands"
TRAINERS_UNDER_DEEPSPEED = ("train_sft", "train_rm", "train_dpo", "train_kto")

MIGRATION_PLACEHOLDER = """# From OpenRLHF: flat and dotted flags

This page is generated from the flag definitions (the table of every OpenRLHF flag, flat and dotted, with its
rlhfkit equivalent) and is not in this checkout yet. Until it is, the flags of each command are on its page under
[Commands](cli/index.md): every OpenRLHF flat flag of OpenRLHF's example commands is accepted under the same name.
"""


def _commands():
    return catalog.commands()


def on_config(config, **kwargs):
    """Replace the `Commands` nav entry by an overview and one entry per command."""
    pages = [{"Overview": "cli/index.md"}] + [{f"rlhfkit {c.name}": f"cli/{c.name}.md"} for c in _commands()]
    for i, item in enumerate(config["nav"] or []):
        if isinstance(item, dict) and NAV_KEY in item:
            config["nav"][i] = {NAV_KEY: pages}
    return config


def on_files(files, config, **kwargs):
    for command in _commands():
        files.append(File.generated(config, f"cli/{command.name}.md", content=command_page(command)))
    files.append(File.generated(config, "cli/index.md", content=overview_page()))
    if files.get_file_from_path("migration.md") is None:
        files.append(File.generated(config, "migration.md", content=MIGRATION_PLACEHOLDER))
    return files


def overview_page() -> str:
    lines = ["# Commands", "",
             "Every command runs as `rlhfkit <command> [flags]` or `python -m rlhfkit.cli.<module> [flags]`; a YAML "
             "or JSON file given with `--config` may stand in for flags (flags on the command line win). Bad input "
             "stops with one line on stderr and exit code 2.", "",
             "| command | module | what it does |", "| --- | --- | --- |"]
    lines += [f"| [`rlhfkit {c.name}`]({c.name}.md) | `{c.module_path}` | {c.summary} |" for c in _commands()]
    return "\n".join(lines) + "\n"


def command_page(command) -> str:
    module = command.load()
    doc = (module.__doc__ or "").strip()
    first, _, rest = doc.partition("\n")
    out = [f"# rlhfkit {command.name}", "", f"{command.summary[:1].upper()}{command.summary[1:]}.", ""]
    if first:
        out += [first.rstrip(), ""]
    out += docstring_markdown(rest)
    out += ["## Run it", "", "```bash", f"rlhfkit {command.name} [flags]", f"python -m {command.module_path} [flags]"]
    if command.module in TRAINERS_UNDER_DEEPSPEED:
        out += [f"deepspeed --module {command.module_path} [flags]       # one process per GPU",
                f"torchrun --nproc_per_node N -m {command.module_path} [flags]"]
    out += ["```", "", "## Flags", ""]
    cls = catalog.config_class(command)
    if cls is not None:
        out += [f"Parsed into `{cls.__module__}.{cls.__name__}`; `--config FILE` (YAML or JSON, flat or by "
                "section) supplies defaults that flags override.", "", flag_table(cls)]
    else:
        parser = catalog.parser_of(command)
        out += [parser_table(parser) if parser is not None else "This command takes no flags."]
    return "\n".join(out) + "\n"


def parser_table(parser: argparse.ArgumentParser) -> str:
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flags = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.dest}` (positional)"
        default = "" if action.default in (None, argparse.SUPPRESS) else f"`{action.default}`"
        text = (action.help or "").replace("|", "\\|")
        if action.choices:
            text += f"{'' if text.endswith('.') else '.'} One of: {', '.join(map(str, action.choices))}."
        rows.append(f"| {flags} | {default} | {text} |")
    return "\n".join(rows)



def docstring_markdown(text: str) -> list[str]:
    """A CLI docstring's body as Markdown: prose stays prose, indented lines (examples) become code blocks."""
    out: list[str] = []
    code: list[str] = []
    for line in text.strip("\n").splitlines():
        if line.startswith("    "):
            code.append(line[4:])
            continue
        if code:
            out += ["```bash", *code, "```", ""]
            code = []
        out.append(line.strip())
    if code:
        out += ["```bash", *code, "```"]
    return out + [""]
