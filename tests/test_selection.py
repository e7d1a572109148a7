"""Every entry of tests/selection.py's lists names a test module or test function that exists: a renamed or moved
test must not fall silently out of the `slow` selection or out of the "ray" worker group."""

from __future__ import annotations

import ast

import pytest

from tests.selection import RAY, SLOW, TESTS


def functions_of(module: str) -> set[str]:
    tree = ast.parse((TESTS / module).read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize("entry", sorted(SLOW | RAY))
def test_entry_names_an_existing_test(entry):
    module, _, function = entry.partition("::")
    assert (TESTS / module).is_file(), f"{entry}: no such test module"
    if function:
        assert function in functions_of(module), f"{entry}: no such test function in {module}"
