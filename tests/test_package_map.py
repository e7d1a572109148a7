"""rlhfkit/package_map.py: the cached `packages_distributions()` gives the standard library's mapping, follows
installs and removals, survives a broken cache file, and is what `import transformers` calls after `import rlhfkit`."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhfkit import package_map

ROOT = Path(__file__).resolve().parents[1]
PAST_NS = itertools.count(1_700_000_000 * 10**9, 10**6)  # distinct modification times, settled long ago


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "package-map"


def add_dist(folder: Path, name: str, packages: list[str], *, top_level: bool) -> None:
    """A minimal installed distribution: METADATA, and either top_level.txt or a RECORD naming its modules."""
    info = folder / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n", encoding="utf-8")
    if top_level:
        (info / "top_level.txt").write_text("".join(p + "\n" for p in packages), encoding="utf-8")
    else:
        record = "".join(f"{p}/__init__.py,,\n" for p in packages) + f"{info.name}/METADATA,,\n"
        (info / "RECORD").write_text(record, encoding="utf-8")
    os.utime(folder, ns=(0, next(PAST_NS)))  # a new time even on a coarse clock


def test_equals_the_standard_mapping_cold_and_warm(cache):
    standard = package_map.STANDARD()
    assert package_map.packages_distributions() == standard  # cold: derived, and written
    written = list(cache.glob("*.json"))
    assert written, "the venv's site-packages should be cached"
    assert package_map.packages_distributions() == standard  # warm: read from the files


def test_a_new_or_removed_distribution_is_seen(cache, tmp_path, monkeypatch):
    site = tmp_path / "site"
    add_dist(site, "alpha-dist", ["alpha"], top_level=True)
    monkeypatch.syspath_prepend(str(site))
    assert package_map.packages_distributions()["alpha"] == ["alpha-dist"]
    add_dist(site, "beta-dist", ["beta", "gamma"], top_level=False)  # inferred from RECORD
    mapping = package_map.packages_distributions()
    assert mapping["beta"] == ["beta-dist"] and mapping["gamma"] == ["beta-dist"]
    assert mapping == package_map.STANDARD()
    for path in (site / "alpha_dist-1.0.dist-info").iterdir():
        path.unlink()
    (site / "alpha_dist-1.0.dist-info").rmdir()
    os.utime(site, ns=(0, next(PAST_NS)))
    assert "alpha" not in package_map.packages_distributions()


def test_a_broken_or_stale_cache_file_is_derived_again(cache, tmp_path, monkeypatch):
    site = tmp_path / "site"
    add_dist(site, "alpha-dist", ["alpha"], top_level=True)
    monkeypatch.syspath_prepend(str(site))
    package_map.packages_distributions()
    files = [p for p in cache.glob("*.json") if str(site) in p.read_text(encoding="utf-8")]
    assert len(files) == 1
    files[0].write_text("{not json", encoding="utf-8")
    assert package_map.packages_distributions()["alpha"] == ["alpha-dist"]
    assert '"alpha"' in files[0].read_text(encoding="utf-8")  # rewritten


def test_a_folder_changed_just_now_is_not_stored(cache, tmp_path, monkeypatch):
    site = tmp_path / "site"
    add_dist(site, "alpha-dist", ["alpha"], top_level=True)
    os.utime(site)  # now: it may change again within its clock's resolution
    monkeypatch.syspath_prepend(str(site))
    assert package_map.packages_distributions()["alpha"] == ["alpha-dist"]
    assert not any(str(site) in p.read_text(encoding="utf-8") for p in cache.glob("*.json"))


def test_an_unwritable_cache_still_gives_the_mapping(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("", encoding="utf-8")
    monkeypatch.setenv("RLHFKIT_CACHE_DIR", str(blocker))  # a file: no folder can be made under it
    assert package_map.packages_distributions() == package_map.STANDARD()


def test_another_distribution_finder_keeps_the_standard_function(monkeypatch):
    class Finder:
        def find_distributions(self, context=None):
            return iter(())

    assert package_map.applies()
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, Finder()])
    assert not package_map.applies()
    monkeypatch.setattr(package_map, "STANDARD", lambda: {"from": ["the standard function"]})
    assert package_map.packages_distributions() == {"from": ["the standard function"]}
    monkeypatch.undo()
    monkeypatch.setenv(package_map.DISABLE_ENV, "1")
    assert not package_map.applies()


def _transformers_in_fresh_process(tmp_path: Path, extra_env: dict[str, str]) -> list[str]:
    code = ("import importlib.metadata as m, rlhfkit, transformers.utils.import_utils as iu\n"
            "from rlhfkit import package_map as pm\n"
            "print(m.packages_distributions is pm.packages_distributions,"
            " iu.PACKAGE_DISTRIBUTION_MAPPING == pm.STANDARD())\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RLHFKIT_CACHE_DIR": str(tmp_path / "cache"), **extra_env}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_transformers_reads_the_cached_mapping_after_import_rlhfkit(tmp_path):
    assert _transformers_in_fresh_process(tmp_path, {}) == ["True", "True"]
    assert list((tmp_path / "cache" / "package-map").glob("*.json"))
    assert _transformers_in_fresh_process(tmp_path, {package_map.DISABLE_ENV: "1"}) == ["False", "True"]
