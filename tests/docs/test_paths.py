"""No stale path in the prose: README.md, CHANGELOG.md, the Markdown pages under docs/, and the docstrings and
comments of rlhfkit/, tests/, bench/, examples/ and docs/_hooks/ name only repository paths (`rlhfkit/...`,
`tests/...`, `bench/...`, `docs/...`, `examples/...`, `deploy/...`) and `rlhfkit.*` modules that exist, and none
of them cites the design document that the repository does not hold (DESIGN, below: the architecture is
docs/architecture.md).

A path with a placeholder (`<date>`, `{name}`, `...`) is not checked; one with a `*` must match some file. The
repository's files are those git tracks plus the untracked ones it does not ignore, so a path that exists only as
a local build output (which a fresh clone lacks) counts as stale, unless GENERATED names it.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import subprocess
import tokenize
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOP_FOLDERS = ("rlhfkit", "tests", "bench", "docs", "examples", "deploy")
# a repository path: one of the top folders at a word start (not inside a URL, `../x/` or `a/b/`), then path text
PATH = re.compile(r"(?<![\w./-])(?:" + "|".join(TOP_FOLDERS) + r")/[\w./*<>{}-]*")
MODULE = re.compile(r"(?<![\w./-])rlhfkit(?:\.[A-Za-z_]\w*)+")
PLACEHOLDER = re.compile(r"[<>{}]|\.\.\.")
# written by a command, never committed: `make bench` installs TRL into bench/.trl; `make docs` writes site/
GENERATED = {"bench/.trl"}
NOT_PATHS = {"rlhfkit/TRL"}  # the benchmarks' ratio column, "rlhfkit / TRL"
DESIGN = "DESIGN" + ".md"  # spelled in two parts so that this file does not cite it


def repository_files() -> set[str]:
    """Tracked files and untracked files git does not ignore, as repository-relative paths."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an sdist): what is on disk
        return {str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()}
    return {line for line in out.splitlines() if (REPO / line).exists()}


FILES = repository_files()
DIRS = {str(Path(f).parents[i]) for f in FILES for i in range(len(Path(f).parts) - 1)}


def path_exists(path: str) -> bool:
    path = path.rstrip("/")
    if "*" in path:
        return any(fnmatch.fnmatch(f, path) for f in FILES)
    return path in FILES or path in DIRS or path in GENERATED or path in NOT_PATHS


def module_exists(dotted: str) -> bool:
    """`rlhfkit.<package>.<module>.<name>`: packages and modules down the path, then (at most) one attribute that
    the last module defines, imports or mentions."""
    parts = dotted.split(".")
    here = Path("rlhfkit")
    for i, part in enumerate(parts[1:], start=1):
        if str(here / part) in DIRS:
            here = here / part
            continue
        if f"{here / part}.py" in FILES:
            here = here / part
            continue
        source = here / "__init__.py" if str(here) in DIRS else Path(f"{here}.py")
        return i > 1 and str(source) in FILES and re.search(rf"\b{re.escape(part)}\b", (REPO / source).read_text())
    return True


def prose_of_python(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python file."""
    text = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                yield first.lineno, first.value.value


def prose_of_shell(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.lstrip().startswith("#"):
            yield number, line


def prose() -> Iterator[tuple[str, int, str]]:
    """(file, line, text) of everything the rule covers."""
    for name in sorted(FILES):
        path = REPO / name
        top = name.split("/")[0]
        if name in ("README.md", "CHANGELOG.md") or (top == "docs" and name.endswith(".md")):
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                yield name, number, line
        elif top in ("rlhfkit", "tests", "bench", "examples") or name.startswith("docs/_hooks/"):
            if name.endswith(".py"):
                yield from ((name, n, t) for n, t in prose_of_python(path))
            elif name.endswith(".sh"):
                yield from ((name, n, t) for n, t in prose_of_shell(path))


def stale_references() -> list[str]:
    found = []
    for name, number, text in prose():
        for match in PATH.finditer(text):
            path = match.group().rstrip(".,:;)'\"`")
            if not PLACEHOLDER.search(path) and not path_exists(path):
                found.append(f"{name}:{number}: {path}")
        for match in MODULE.finditer(text):
            dotted = match.group().rstrip(".")
            if not module_exists(dotted):
                found.append(f"{name}:{number}: {dotted}")
        if DESIGN in text:
            found.append(f"{name}:{number}: {DESIGN} (not in the repository: point at docs/architecture.md)")
    return found


def test_the_prose_names_only_paths_and_modules_that_exist():
    stale = stale_references()
    assert not stale, f"{len(stale)} stale references:\n" + "\n".join(stale)


def test_the_rule_sees_stale_paths_and_modules():
    assert path_exists("rlhfkit/cli/main.py") and path_exists("docs/") and path_exists("tests/docs/*.py")
    assert not path_exists("rlhfkit/cli/no_such_module.py") and not path_exists("examples/*.no_such_suffix")
    assert module_exists("rlhfkit.cli.catalog.commands") and module_exists("rlhfkit.config")
    assert not module_exists("rlhfkit.no_such_package") and not module_exists("rlhfkit.cli.catalog.no_such_name")
    text = "see `rlhfkit/cli/gone.py`, https://host/examples/x.py, ../shared/seeds/ and bench/results/<date>.md"
    assert [m.group() for m in PATH.finditer(text)] == ["rlhfkit/cli/gone.py", "bench/results/<date>.md"]
