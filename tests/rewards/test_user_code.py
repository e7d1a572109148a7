"""The worker pool for user code: every way a call can go wrong costs that call, and the pool goes on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhfkit.rewards.user_code import UserCodeLoadError, UserCodePool

USER_FILE = """
import ctypes, os, subprocess, sys, time


def echo(x, scale=1):
    return x * scale


def bad(kind):
    if kind == "raise":
        raise ValueError("boom\\nsecond line")
    if kind == "exit":
        os._exit(7)
    if kind == "segfault":
        ctypes.string_at(0)
    if kind == "sys_exit":
        sys.exit(3)
    if kind == "generator":
        return (i for i in range(3))
    return kind


def timeout_with_child(pid_file):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    time.sleep(60)


def nap(seconds):
    time.sleep(seconds)
    return os.getpid()


async def add_async(a, b):
    return a + b
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


@pytest.fixture
def user_file(tmp_path) -> str:
    path = tmp_path / "user_code.py"
    path.write_text(USER_FILE)
    return str(path)


def test_bad_calls_each_cost_one_call_and_crashed_workers_are_replaced(user_file):
    with UserCodePool(user_file, workers=1, timeout=10) as pool:
        assert {"echo", "bad", "nap", "add_async"} <= pool.functions
        first_pid = pool.worker_pids()[0]
        ok = pool.call("echo", "ab", scale=2)
        assert ok.ok and ok.value == "abab"
        raised = pool.call("bad", "raise")
        assert (raised.kind, raised.error) == ("exception", "bad raised ValueError: boom")
        assert pool.call("bad", "sys_exit").error == "bad raised SystemExit: 3"
        assert pool.worker_pids() == [first_pid]  # an exception leaves the worker alive
        assert pool.call("bad", "generator").kind == "bad_output"
        exited = pool.call("bad", "exit")
        assert (exited.kind, exited.error) == ("crash", "bad: the worker exited (exit code 7)")
        assert pool.replaced == 1 and not alive(first_pid)
        segfault = pool.call("bad", "segfault")
        assert (segfault.kind, segfault.error) == ("crash", "bad: the worker died (signal SIGSEGV)")
        assert pool.replaced == 2
        assert pool.call("echo", 3).value == 3  # the replacement serves
        assert pool.call("add_async", 2, 3).value == 5  # an async function is awaited in the worker
        pids = pool.worker_pids()
    assert not any(alive(p) for p in pids)  # closed: no worker left


def test_timeout_kills_the_worker_with_its_children(user_file, tmp_path):
    pid_file = tmp_path / "child.pid"
    with UserCodePool(user_file, workers=1, timeout=1.5) as pool:
        worker = pool.worker_pids()[0]
        started = time.perf_counter()
        result = pool.call("timeout_with_child", str(pid_file))
        assert time.perf_counter() - started < 5
        assert (result.kind, result.error) == ("timeout", "timeout_with_child took more than 1.5 s (killed)")
        child = int(pid_file.read_text())
        deadline = time.time() + 5
        while (alive(child) or alive(worker)) and time.time() < deadline:
            time.sleep(0.05)
        assert not alive(worker) and not alive(child)
        assert pool.call("echo", 1).value == 1 and pool.replaced == 1


def test_calls_run_on_all_workers_at_once_in_order(user_file):
    with UserCodePool(user_file, workers=2, timeout=10) as pool:
        started = time.perf_counter()
        results = pool.map("nap", [(0.8,), (0.8,)])
        elapsed = time.perf_counter() - started
        assert elapsed < 1.5, elapsed  # one after the other would take 1.6 s
        assert sorted(r.value for r in results) == sorted(pool.worker_pids())
        assert [r.value for r in pool.map("echo", [(i,) for i in range(6)])] == list(range(6))


def test_bad_file_is_a_load_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import not_a_module_anywhere\n")
    with pytest.raises(UserCodeLoadError, match="ModuleNotFoundError: No module named 'not_a_module_anywhere'"):
        UserCodePool(str(path))


def test_workers_end_when_their_parent_crashes(user_file):
    """A trainer killed hard (no close) leaves no worker behind: each watches its parent."""
    # rlhfkit.rewards imports no torch, so the pool starts in this child in well under a second
    script = ("import os; from rlhfkit.rewards.user_code import UserCodePool; "
              f"p = UserCodePool({user_file!r}, workers=2); print(*p.worker_pids(), flush=True); os._exit(1)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[2])
    pids = [int(x) for x in proc.stdout.split()]
    assert len(pids) == 2, proc.stderr
    deadline = time.time() + 5
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)
