"""Print OpenRLHF's CLI defaults as the `OPENRLHF` table of rlhfkit/config/openrlhf_defaults.py.

    python tools/openrlhf_defaults.py path/to/openrlhf/cli/train_sft.py path/to/.../train_rm.py ...

Reads each file's `parser.add_argument("--flag", ..., default=...)` calls with `ast` (nothing is imported or run)
and prints `"command": {"flag": default, ...}` entries, one command per file (named after the file). A default
that is an expression is evaluated when it is plain arithmetic on constants (`int(1e8)`, `float('inf')`,
`1e-6 if prefix == "actor" else 9e-6`); flags written in a loop (`for prefix in ("actor", "critic"):` with
`f"--{prefix}.adam.lr"`) are expanded; a run name built from the start time (`'sft_%s' % datetime.now()...`)
becomes "sft_(start time)". Negation aliases (`--x.no_y`, dest=...) are skipped: their flag's own default counts.
Not needed at test time: its output is pasted into the module, which the tests read.
"""

from __future__ import annotations

import ast
import math
import sys
from pathlib import Path
from typing import Any


class Unsupported(Exception):
    """A default this reader cannot evaluate; the message names it so the table can be written by hand."""


def evaluate(node: ast.AST, env: dict[str, Any]) -> Any:
    """A constant expression of an argparse default: constants, tuples/lists, unary minus, int()/float() of a
    constant, `a if name == c else b` and f-strings over the loop variables in `env`."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return [evaluate(e, env) for e in node.elts]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand, env)
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("int", "float"):
        (arg,) = node.args
        value = evaluate(arg, env)
        return math.inf if node.func.id == "float" and value == "inf" else {"int": int, "float": float}[
            node.func.id](value)
    if isinstance(node, ast.IfExp) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1 \
            and isinstance(node.test.ops[0], ast.Eq):
        same = evaluate(node.test.left, env) == evaluate(node.test.comparators[0], env)
        return evaluate(node.body if same else node.orelse, env)
    if isinstance(node, ast.JoinedStr):
        return "".join(str(evaluate(v.value if isinstance(v, ast.FormattedValue) else v, env)) for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) \
            and "datetime" in ast.unparse(node.right):
        return node.left.value.replace("%s", "(start time)")
    raise Unsupported(ast.unparse(node))


def _loop_envs(node: ast.For, env: dict[str, Any]) -> list[dict[str, Any]]:
    """One environment per value of a loop over constants (`for prefix in ("actor", "critic"):`)."""
    if not isinstance(node.target, ast.Name):
        raise Unsupported(ast.unparse(node.target))
    return [{**env, node.target.id: value} for value in evaluate(node.iter, env)]


def read_defaults(path: Path) -> dict[str, Any]:
    """{flag without the leading dashes: default} of every option the file adds to an argparse parser."""
    flags: dict[str, Any] = {}

    def visit(node: ast.AST, env: dict[str, Any]) -> None:
        if isinstance(node, ast.For) and isinstance(node.iter, (ast.Tuple, ast.List)):
            for loop_env in _loop_envs(node, env):
                for child in node.body:
                    visit(child, loop_env)
            return
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            add(node, env)
        for child in ast.iter_child_nodes(node):
            visit(child, env)

    def add(call: ast.Call, env: dict[str, Any]) -> None:
        kw = {k.arg: k.value for k in call.keywords}
        names = [evaluate(a, env) for a in call.args]
        if not names or not str(names[0]).startswith("--") or "dest" in kw:
            return
        action = evaluate(kw["action"], env) if "action" in kw else None
        if "default" in kw:
            value = evaluate(kw["default"], env)
        else:
            value = {"store_true": False, "store_false": True}.get(action)
        flags[names[0][2:]] = value

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), {})
    return flags


def render(command: str, flags: dict[str, Any], width: int = 116) -> str:
    """`"command": {...},` with the flags sorted and packed several to a line."""
    lines, line = [f'    "{command}": {{'], "       "
    for flag in sorted(flags):
        value = flags[flag]
        item = f' "{flag}": {"math.inf" if value == math.inf else repr(value)},'
        if len(line) + len(item) > width:
            lines.append(line)
            line = "       "
        line += item
    lines += [line, "    },"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write(__doc__)
        return 2
    for name in argv:
        path = Path(name)
        try:
            print(render(path.stem, read_defaults(path)))
        except Unsupported as e:
            sys.stderr.write(f"{path}: cannot evaluate the default {e}; write it by hand\n")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
