"""What a reward file's function can take, read from its source (the user's code is imported only in the worker
processes, rlhfkit.rewards.user_code), so a wrong signature fails at start-up, not at the first rollout."""

from __future__ import annotations

import ast
from pathlib import Path


def _function_args(path: str, name: str) -> ast.arguments | None:
    """The arguments of the file's last top-level `def name(...)`; None when there is none or the file does not
    parse (the worker already imported it; whatever this is, the call will tell)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    return defs[-1].args if defs else None


def wrong_signature(path: str, name: str, n_args: int) -> str | None:
    """`(queries)` when the file's top-level `def name(...)` cannot take `n_args` positional arguments, else None.
    A function defined any other way (imported, assigned) is left to fail at call time."""
    a = _function_args(path, name)
    if a is None:
        return None
    positional = len(a.posonlyargs) + len(a.args)
    required = positional - len(a.defaults)
    required_kwonly = sum(d is None for d in a.kw_defaults)
    if a.vararg is None and positional < n_args or required > n_args or required_kwonly:
        return f"({ast.unparse(a)})"
    return None


def takes_keyword(path: str, name: str, keyword: str) -> bool:
    """Whether the file's top-level `def name(...)` takes `keyword` by name (or any keyword through `**kwargs`)."""
    a = _function_args(path, name)
    if a is None:
        return False
    names = [arg.arg for arg in (*a.args, *a.kwonlyargs)]
    return a.kwarg is not None or keyword in names
