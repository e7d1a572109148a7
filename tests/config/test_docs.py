"""The README documents every flag of every trainer, generated from the configs."""

from __future__ import annotations

from pathlib import Path

from rlhfkit.config.base import iter_fields
from rlhfkit.config.docs import TABLES, load_config_class, render

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_flag_tables_are_current():
    text = README.read_text()
    assert render(text) == text, "run: python -m rlhfkit.config.docs README.md"


def test_every_existing_config_is_documented():
    text = README.read_text()
    for marker, spec in TABLES.items():
        cls = load_config_class(spec)
        if cls is None:
            continue
        assert f"<!-- flags:{marker} -->" in text, f"README has no flag table for {marker}"
        for _, name, field, _ in iter_fields(cls):
            assert f"`--{name}`" in text
            assert field.metadata.get("help"), f"--{name} has no help text"
