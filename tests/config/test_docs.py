"""Every flag of every command is documented from the configs: the docs site's command pages are generated from
the config classes of `rlhfkit.config.docs.TABLES` (tests/docs/test_docs_site.py checks each page lists every flag),
so those classes must be the commands' own, and every flag needs its help text. The README keeps no hand-made copy
of a flag table: it links the command pages."""

from __future__ import annotations

from pathlib import Path

from rlhfkit.cli import catalog
from rlhfkit.config.base import iter_fields
from rlhfkit.config.docs import TABLES, load_config_class, render

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_table_config_is_the_config_of_its_command():
    commands = {c.name: c for c in catalog.commands()}
    for marker, spec in TABLES.items():
        cls = load_config_class(spec)
        if cls is None:
            continue
        assert marker in commands, f"TABLES names {marker}, which is not a command of rlhfkit/cli/main.py"
        assert catalog.config_class(commands[marker]) is cls
        assert commands[marker].load().__dict__.get(cls.__name__) is cls, f"{marker} does not parse {spec}"
        for _, name, field, _ in iter_fields(cls):
            assert field.metadata.get("help"), f"--{name} has no help text"


def test_readme_has_no_flag_tables_to_keep_current():
    text = README.read_text()
    assert "<!-- flags:" not in text, "flag tables live on the docs site's command pages, not in the README"
    assert render(text) == text
