"""rlhfkit's import graph, read statically (AST, every `import` including the ones inside functions): no cycle,
the layer order of docs/architecture.md, and no entry-point module importing another.

Layers, first to last, one per folder (a module imports only from its own folder or earlier ones): the fenced
`layers` block of docs/architecture.md, read here, so the list is stated once.
Allowed everywhere: `rlhfkit` itself (the version), `rlhfkit.errors` (UserError), `rlhfkit.package_map` (which
`rlhfkit` imports) and `rlhfkit.cache` (the cache folder, which package_map needs).

Entry-point modules (ENTRY_POINTS): the modules whose `run_*` function a CLI calls (run_sft, run_rm, run_dpo,
run_kto in trainers/, run_ppo, run_ppo_ray and run_teacher_server in rl/, run_batch_inference in inference/); every
such module the CLI imports must be one. The rest of trainers/, rl/ and inference/ is shared machinery that imports
no entry point. A CLI names its entry point as a "module:function" string that `rlhfkit.cli.common.run_config`
imports when it runs; such a string counts as an import of that module here.

Spec-only layers (SPEC_ONLY): distributed/, rollout/, models/ and agents/ take the small specs of
`rlhfkit/config/specs.py` (derived once by `rlhfkit/config/rl_specs.py`), never the RL config or its sections.

Run assembly (strategy, tokenizer, datasets, model, logger) is written once, in `rlhfkit/run/setup.py`: no
other module builds a strategy or a metrics logger itself.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "rlhfkit"
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def layers_from_docs() -> list[tuple[str, ...]]:
    """The layer list of docs/architecture.md: its fenced `layers` block, one folder per line, first layer first."""
    blocks = re.findall(r"```layers\n(.*?)```", ARCHITECTURE.read_text(encoding="utf-8"), re.S)
    assert len(blocks) == 1, f"{ARCHITECTURE} needs exactly one ```layers block (found {len(blocks)})"
    return [(name,) for name in blocks[0].split()]


LAYERS: list[tuple[str, ...]] = layers_from_docs()
EVERYWHERE = {"rlhfkit", "rlhfkit.errors", "rlhfkit.package_map", "rlhfkit.cache"}
RUNNER = re.compile(r"(rlhfkit(?:\.\w+)+):\w+")  # "rlhfkit.trainers.sft:run_sft", as given to run_config
ENTRY_POINTS = {f"rlhfkit.trainers.{m}" for m in ("sft", "reward", "dpo", "kto")} | {
    "rlhfkit.rl.local_run", "rlhfkit.rl.ray_run", "rlhfkit.rl.teacher_server", "rlhfkit.inference.batch"}
ENTRY_FOLDERS = ("rlhfkit.trainers.", "rlhfkit.rl.", "rlhfkit.inference.")
CHAT = "rlhfkit.inference.chat"  # the interactive chat session, driven by the chat CLI's own loop
# The parts below the RL stack take the small specs of `rlhfkit.config.specs`, never the RL config itself.
SPEC_ONLY = ("rlhfkit.distributed.", "rlhfkit.rollout.", "rlhfkit.models.", "rlhfkit.agents.")
RL_CONFIG = {"rlhfkit.config.rl", "rlhfkit.config.rl_sections", "rlhfkit.config.rl_resources",
             "rlhfkit.config.rl_specs"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The rlhfkit modules `path` imports; `from pkg import name` counts as pkg.name when that is a module."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "rlhfkit")
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "rlhfkit":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and RUNNER.fullmatch(node.value):
            found.add(RUNNER.fullmatch(node.value).group(1))
    unknown = found - set(modules)
    assert not unknown, f"{path} imports modules that do not exist: {sorted(unknown)}"
    return found


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def layer_of(module: str) -> int | None:
    if module in EVERYWHERE:
        return None
    package = module.split(".")[1]
    for i, names in enumerate(LAYERS):
        if package in names:
            return i
    raise AssertionError(f"{module}: package {package!r} has no layer; add it to docs/architecture.md's layers block")


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None. Depth-first search with colours."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle():
    edges = graph()
    assert len(edges) > 50  # the whole package was read
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_layers_import_only_earlier_layers():
    wrong = []
    for module, targets in graph().items():
        mine = layer_of(module)
        for target in targets:
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                wrong.append(f"{module} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert not wrong, "layer order broken:\n" + "\n".join(sorted(wrong))


def test_no_entry_point_imports_another():
    edges = graph()
    modules = all_modules()
    for name in ENTRY_POINTS:
        tree = ast.parse(modules[name].read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name.startswith("run_") for n in tree.body), name
    called_by_cli = {t for m, targets in edges.items() if m.startswith("rlhfkit.cli") for t in targets
                     if t.startswith(ENTRY_FOLDERS)}
    stray = called_by_cli - ENTRY_POINTS - {CHAT}
    assert called_by_cli and not stray, f"the CLI calls into {sorted(stray)}"
    wrong = [f"{m} imports {t}" for m in sorted(n for n in edges if n.startswith(ENTRY_FOLDERS))
             for t in sorted(edges[m] & ENTRY_POINTS)]
    assert not wrong, ("entry-point modules are imported only by the CLI; move what they share into a module of its "
                       "own:\n" + "\n".join(wrong))


ASSEMBLY = {"make_strategy": "rlhfkit.run.setup", "make_logger": "rlhfkit.run.setup"}


def test_run_assembly_is_written_once():
    """Every trainer and both RL runners get their strategy and logger from `run/setup.py` (`assemble_offline`,
    `build_strategy`, `train_rl`); a module that calls `make_strategy` or `make_logger` itself is a copied assembly
    block. Likewise the CLI entry points parse and run through `cli.common.cli_main`."""
    wrong = []
    for name, path in all_modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ASSEMBLY \
                    and name != ASSEMBLY[node.func.id]:
                wrong.append(f"{name}:{node.lineno} calls {node.func.id}")
    assert not wrong, "run assembly outside run/setup.py:\n" + "\n".join(wrong)
    for path in sorted((ROOT / "cli").glob("train_*.py")) + [ROOT / "cli" / "batch_inference.py"]:
        calls = {n.func.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name)}
        assert "cli_main" in calls and "parse_config" not in calls, path.name


def test_engines_roles_and_placement_never_see_the_rl_config():
    """distributed/, rollout/, models/ and agents/ are handed specs (`rlhfkit.config.specs`): none imports the RL
    config or the modules that read it, and none takes a parameter named `cfg` (the RL config under another type)."""
    wrong = [f"{m} imports {t}" for m, targets in sorted(graph().items()) if m.startswith(SPEC_ONLY)
             for t in sorted(targets & RL_CONFIG)]
    for name, path in sorted(all_modules().items()):
        if name.startswith(SPEC_ONLY):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                    wrong += [f"{name}:{node.lineno} {node.name}({a.arg})" for a in args if a.arg == "cfg"]
    assert not wrong, "the RL config below the RL stack (take a spec instead):\n" + "\n".join(wrong)
