"""rlhfkit.cache: one cache folder for every user of it, named by the environment the documented way."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhfkit import package_map
from rlhfkit.cache import cache_root, write_atomically
from rlhfkit.cli.real_model_assets import site_dir
from rlhfkit.models.gguf import converted_dir


def test_rlhfkit_cache_dir_wins_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("RLHFKIT_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root() == tmp_path / "home" / ".cache" / "rlhfkit"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "rlhfkit"
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", "~/mine")
    assert cache_root() == tmp_path / "home" / "mine"  # `~` expanded, no "rlhfkit" added: the user named the folder


def test_every_user_of_the_cache_is_under_the_one_root(monkeypatch, tmp_path):
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    under = [package_map.cache_dir(), site_dir(), converted_dir(model)]
    assert [Path(p).relative_to(tmp_path).parts[0] for p in under] == ["package-map", "real_model", "gguf"]


def test_write_atomically_replaces_the_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "record.json"
    write_atomically(path, "old")
    write_atomically(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["record.json"]
    (tmp_path / "a_folder").mkdir()
    with pytest.raises(OSError):  # a folder cannot be replaced by a file: the error is raised, the temporary removed
        write_atomically(tmp_path / "a_folder", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_folder", "record.json"]
