"""Write the flag tables of the docs from the config dataclasses: `python -m rlhfkit.config.docs docs/migration.md`.

`TABLES` names the config class of each command it lists (`rlhfkit.cli.catalog` reads it; the docs site's command
pages are generated from those classes at build time by docs/_hooks/cli_pages.py). In a Markdown file, a table lives
between `<!-- flags:NAME -->` and `<!-- /flags:NAME -->` markers (every flag of NAME), or
`<!-- migration:NAME -->` and `<!-- /migration:NAME -->` (docs/migration.md: each flag in rlhfkit's and OpenRLHF's
spellings), `<!-- migration-unsupported -->` (OpenRLHF flags rlhfkit has no equivalent for yet), or
`<!-- migration-defaults -->` (the defaults that differ from OpenRLHF 0.11's, `openrlhf_defaults`), so the prose
stays hand-written while the tables cannot drift from the code (tests check they are current).
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

from rlhfkit.config import openrlhf_names as theirs
from rlhfkit.config.base import field_names, flag_table, iter_fields
from rlhfkit.config.openrlhf_defaults import defaults_table

# marker name -> "module:Class" of the config it documents (only those that exist are rendered)
TABLES = {
    "train_sft": "rlhfkit.config.sft:SFTConfig",
    "train_rm": "rlhfkit.config.preference:RMConfig",
    "train_dpo": "rlhfkit.config.preference:DPOConfig",
    "train_kto": "rlhfkit.config.preference:KTOConfig",
    "train_ppo": "rlhfkit.config.rl:PPOConfig",
    "batch_inference": "rlhfkit.config.batch_inference:BatchInferenceConfig",
    "lora_combiner": "rlhfkit.config.lora_combiner:LoraCombinerConfig",
    "interactive_chat": "rlhfkit.config.chat:ChatConfig",
}


def load_config_class(spec: str) -> type | None:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def migration_table(cls: type) -> str:
    """Every flag of `cls` in three spellings: rlhfkit's, OpenRLHF's flat (up to 0.10.1), OpenRLHF's dotted."""
    fields = field_names(cls)
    rows = ["| rlhfkit | OpenRLHF flat (<= 0.10.1) | OpenRLHF dotted (0.10.2+) |", "| --- | --- | --- |"]
    for _, name, _, _ in iter_fields(cls):
        others = theirs.openrlhf_flags_of(name, fields)
        flat = [] if name in theirs.RLHFKIT_ONLY else [name]
        flat += [o for o in others if "." not in o]
        dotted = [o for o in others if "." in o]
        rows.append(f"| `--{name}` | {_codes(flat)} | {_codes(dotted)} |")
    return "\n".join(rows)


def unsupported_table() -> str:
    rows = ["| OpenRLHF flag | why it fails for now |", "| --- | --- |"]
    rows += [f"| `--{flag}` | {reason} |" for flag, reason in sorted(theirs.NOT_SUPPORTED.items())]
    return "\n".join(rows)


def _codes(flags: list[str]) -> str:
    return ", ".join(f"`--{f}`" for f in flags) if flags else "-"


def _replace(text: str, marker: str, table: str) -> str:
    pattern = re.compile(rf"(<!-- {marker} -->\n).*?(<!-- /{marker} -->)", re.S)
    return pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)


def render(text: str) -> str:
    """`text` with every marked table replaced by the current flags."""
    for marker, spec in TABLES.items():
        cls = load_config_class(spec)
        if cls is None:
            continue
        if f"<!-- flags:{marker} -->" in text:
            text = _replace(text, f"flags:{marker}", flag_table(cls))
        if f"<!-- migration:{marker} -->" in text:
            text = _replace(text, f"migration:{marker}", migration_table(cls))
    if "<!-- migration-unsupported -->" in text:
        text = _replace(text, "migration-unsupported", unsupported_table())
    if "<!-- migration-defaults -->" in text:
        text = _replace(text, "migration-defaults", defaults_table())
    return text


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    for path in map(Path, args or ["docs/migration.md"]):
        path.write_text(render(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
