"""The code sandbox: limits that act, nothing left behind, no file outside, no network."""

from __future__ import annotations

import os
import socket

import pytest

from rlhfkit.rewards.sandbox import (
    BWRAP,
    FAILED,
    PASSED,
    TIMEOUT,
    SandboxLimits,
    _processes_of,
    run_python,
    sandbox_problem,
)

# CI installs bubblewrap (.ci/run); without it run_python refuses (tests/rewards/test_sandbox_seccomp.py)
pytestmark = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")
FAST = SandboxLimits(wall_seconds=3.0, cpu_seconds=2, processes=16)


def test_passing_and_failing_programs():
    ok = run_python("print(sum(range(10)))", FAST)
    assert (ok.status, ok.returncode, ok.stdout) == (PASSED, 0, "45\n")
    bad = run_python("assert 1 == 2, 'wrong'", FAST)
    assert bad.status == FAILED and "AssertionError: wrong" in bad.stderr
    inside = run_python("open('here.txt', 'w').write('x'); print(open('here.txt').read())", FAST)
    assert inside.status == PASSED and inside.stdout == "x\n"  # its own directory is writable


@pytest.mark.skipif(os.geteuid() != 0, reason="the per-run uid needs root")
def test_bad_programs_run_as_their_own_uid_and_leave_nothing_behind(tmp_path):
    forker = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    escapee = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n"
    for program, status in ((forker, TIMEOUT), (escapee, PASSED), ("while True:\n    pass\n", TIMEOUT)):
        result = run_python(program, FAST)
        assert result.status == status, result
        assert result.uid >= 1 << 20 and _processes_of(result.uid) == []  # not even the one that left its session
        assert result.seconds < FAST.wall_seconds + 3


def test_bad_allocation_is_refused():
    result = run_python("x = bytearray(10 * 1024 ** 3)\nprint('allocated')", FAST)
    assert result.status == FAILED and "MemoryError" in result.stderr and result.stdout == ""


def test_bad_writes_outside_the_directory_are_refused(tmp_path):
    outside = tmp_path / "open"
    outside.mkdir()
    outside.chmod(0o777)  # the kernel would let any uid write here: the sandbox must refuse it itself
    for program in (f"open({str(outside / 'a.txt')!r}, 'w').write('x')",
                    f"import os\nos.close(os.open({str(outside / 'b.txt')!r}, os.O_CREAT | os.O_WRONLY))",
                    f"import shutil\nopen('c.txt', 'w').close()\nshutil.move('c.txt', {str(outside)!r})",
                    f"import subprocess\nsubprocess.run(['touch', {str(outside / 'd.txt')!r}])"):
        result = run_python(program, FAST)
        assert result.status == FAILED and "PermissionError: sandbox:" in result.stderr, result
    assert list(outside.iterdir()) == []


def test_bad_network_access_is_refused():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    result = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'x')",
                        FAST)
    server.setblocking(False)
    with pytest.raises(BlockingIOError):  # a connection would have been queued by the kernel, accepted or not
        server.accept()
    server.close()
    assert result.status == FAILED and "PermissionError: sandbox: socket" in result.stderr
    assert result.isolation == BWRAP
