"""bench/common.py: a child's peak memory is its own, not its parent's."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

CHILD = f"import sys; sys.path.insert(0, {str(REPO / 'bench')!r}); from common import peak_rss_mb; print(peak_rss_mb())"


def test_a_small_child_of_a_large_parent_reports_its_own_peak():
    large = bytearray(400 * 2**20)
    large[::4096] = b"\1" * len(range(0, len(large), 4096))  # touch every page: 400 MB resident in this process
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    # ru_maxrss would say >= 400 here (Linux carries the parent's high-water mark over the child's exec)
    assert 1 < float(out) < 200, out
    del large
