"""The import-name -> distribution map that Transformers reads at import, cached on disk per sys.path folder.

`import transformers` calls `importlib.metadata.packages_distributions()` once, at module level, to learn which
distribution provides each importable package. The standard library answers by reading every installed
distribution's METADATA and, for the ~half of wheels that ship no `top_level.txt`, every line of their RECORD
(43,000 lines in rlhfkit's venv, 14,667 of them mkdocs-material's): 0.37-0.6 s of each process's start on the
2-core CI machine, a third of `import transformers`. Every Ray role, vLLM engine and CLI run pays it again.

`install()` (called by `rlhfkit/__init__.py`) replaces that function with `packages_distributions()` here, which
gives the same mapping from a per-folder cache: for each folder on `sys.path` that holds distributions, the
(package, distribution name) pairs the standard library would derive from it, stored as JSON in the rlhfkit cache
(`cache_dir()`: `~/.cache/rlhfkit/package-map/` by default) with the folder's modification time. Installing,
upgrading or removing a distribution adds or removes a `*.dist-info` folder, which changes that time, so the
folder's pairs are derived afresh (and stored only once the folder has been still for 2 s, so two changes within one
tick of its clock cannot hide the second). Folders without distributions, zip files on `sys.path` and unreadable or
unwritable caches are read the standard library's way each time. Where an import hook other than Python's own path
finder can report distributions, or this Python's `importlib.metadata` lacks the helpers used here, the standard
function is kept. `RLHFKIT_NO_PACKAGE_MAP_CACHE=1` keeps it too.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import importlib.machinery
import importlib.metadata as metadata
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from rlhfkit.cache import cache_root, write_atomically

DISABLE_ENV = "RLHFKIT_NO_PACKAGE_MAP_CACHE"
STANDARD = metadata.packages_distributions
# A folder changed this recently may change again within its clock's resolution without a new modification time
# (the racy-timestamp case): its pairs are derived but not stored until it has been still this long.
SETTLE_NS = 2_000_000_000
Pairs = list[tuple[str, str]]


def cache_dir() -> Path:
    """`package-map/` in the rlhfkit cache (`rlhfkit.cache.cache_root()`)."""
    return cache_root() / "package-map"


def folder_pairs(folder: str) -> Pairs:
    """The (package, distribution name) pairs `packages_distributions()` derives from the distributions in
    `folder`, in its order (the standard library's own helpers, so the rules of this Python version hold)."""
    top_level_declared = metadata._top_level_declared  # type: ignore[attr-defined]
    top_level_inferred = metadata._top_level_inferred  # type: ignore[attr-defined]
    pairs: Pairs = []
    for dist in metadata.distributions(path=[folder]):
        name = dist.metadata["Name"]
        pairs.extend((pkg, name) for pkg in top_level_declared(dist) or top_level_inferred(dist))
    return pairs


def _read(path: Path, mtime_ns: int) -> Pairs | None:
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("mtime_ns") != mtime_ns:
        return None
    return [(pkg, name) for pkg, name in stored.get("pairs", [])]


def _write(path: Path, folder: str, mtime_ns: int, pairs: Pairs) -> None:
    """Write atomically (a temporary file renamed over the old one): processes that start together never read
    half a file. A cache that cannot be written is skipped: the next process derives the pairs again."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({"folder": folder, "mtime_ns": mtime_ns, "pairs": pairs}))


def cached_folder_pairs(entry: str) -> Pairs:
    """`folder_pairs` of one `sys.path` entry ("" is the working directory), from the cache where it is current."""
    folder = os.path.realpath(entry or ".")
    try:
        mtime_ns = os.stat(folder).st_mtime_ns
    except OSError:
        return []  # a missing entry holds no distributions
    if not os.path.isdir(folder):
        return folder_pairs(entry)  # a zip file: derived each time
    path = cache_dir() / (hashlib.sha256(folder.encode()).hexdigest()[:24] + ".json")
    pairs = _read(path, mtime_ns)
    if pairs is None:
        pairs = folder_pairs(entry)
        settled = time.time_ns() - mtime_ns > SETTLE_NS and os.stat(folder).st_mtime_ns == mtime_ns
        if pairs and settled:
            _write(path, folder, mtime_ns, pairs)
    return pairs


def packages_distributions() -> Mapping[str, list[str]]:
    """`importlib.metadata.packages_distributions()`, the same mapping, from the per-folder cache (the standard
    function's answer wherever `applies()` no longer holds, e.g. an import hook added since `install()`)."""
    if not applies():
        return STANDARD()
    pkg_to_dist: dict[str, list[str]] = collections.defaultdict(list)
    for entry in sys.path:
        for pkg, name in cached_folder_pairs(entry):
            pkg_to_dist[pkg].append(name)
    return dict(pkg_to_dist)


def applies() -> bool:
    """Whether the cache gives the standard answer here: Python's path finder is the only import hook that reports
    distributions, and this `importlib.metadata` has the helpers `folder_pairs` uses."""
    if os.environ.get(DISABLE_ENV, "") == "1":
        return False
    if not all(hasattr(metadata, name) for name in ("_top_level_declared", "_top_level_inferred")):
        return False
    path_finder = importlib.machinery.PathFinder
    return not any(hasattr(f, "find_distributions") for f in sys.meta_path if f is not path_finder)


def install() -> bool:
    """Route `importlib.metadata.packages_distributions` through the cache where `applies()`; True when it did."""
    if not applies():
        return False
    metadata.packages_distributions = packages_distributions
    return True
