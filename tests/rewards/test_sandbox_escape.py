"""Sandbox escapes (issue 25): with the audit hook switched off, every attempt to reach outside is refused or stays
inside, as root and as an unprivileged user (uid 65534 through `setpriv`), and nothing is left behind: no process,
no file. The cases are small programs in sandbox_escapes.py, run by one process per user (their parent, whose
command line and environment carry a secret)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from rlhfkit.rewards.sandbox import BWRAP, processes_of_run, sandbox_problem, sandbox_python
from rlhfkit.rewards.sandbox_bwrap import bwrap_argv, seccomp_file

RUNNER = Path(__file__).with_name("sandbox_escapes.py")
ROOT = Path(__file__).resolve().parents[2]


def _users() -> list[str]:
    users = ["self"]
    if os.geteuid() == 0 and shutil.which("setpriv"):
        users.append("nobody")
    return users


@pytest.fixture(scope="module")
def bwrap_works():
    problem = sandbox_problem()
    if problem is not None:
        print(f"sandbox escape suite skipped: {problem}")  # CI installs bubblewrap (.ci/run)
        pytest.skip(problem)


@pytest.fixture
def targets():
    """The host side: a 0777 checkpoint directory on the read-only root (under /var/tmp, which the sandbox keeps
    visible) holding a file and a 0777 Unix socket, a 0777 /tmp/ray-like directory, a 127.0.0.1 listener; and
    `base`, a 0777 directory in /tmp for the runners' own temporary files (pytest's tmp_path is closed to uid 65534)."""
    checkpoint = Path(tempfile.mkdtemp(prefix="rlhfkit-escape-ckpt-", dir="/var/tmp"))
    base = Path(tempfile.mkdtemp(prefix="rlhfkit-escape-"))
    ray = base / "ray"
    ray.mkdir()
    for directory in (checkpoint, ray, base):
        directory.chmod(0o777)
    for directory in (checkpoint, ray):
        (directory / "keep.txt").write_text("keep")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(checkpoint / "sock"))
    os.chmod(checkpoint / "sock", 0o777)
    tcp = socket.create_server(("127.0.0.1", 0))
    for server in (unix, tcp):
        server.listen(8)
        server.setblocking(False)
    yield {"checkpoint": str(checkpoint), "ray": str(ray), "port": tcp.getsockname()[1],
           "marker": f"escape-{secrets.token_hex(4)}"}, (unix, tcp), base
    unix.close()
    tcp.close()
    shutil.rmtree(checkpoint, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)


def _run_suite(user: str, config: dict, tmpdir: Path, secret: str) -> dict:
    python = sandbox_python()  # readable by another uid
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if user == "nobody" else []
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "TMPDIR": str(tmpdir), "PARENT_SECRET": secret,
           "HOME": str(tmpdir)}
    done = subprocess.run(prefix + [python, str(RUNNER), json.dumps(config), f"--token={secret}"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]  # the parent survived every case (kill, ptrace, fork bomb)
    return json.loads(done.stdout)


@pytest.mark.parametrize("user", _users())
def test_escapes_are_refused_or_contained(bwrap_works, targets, user):
    config, (unix, tcp), base = targets
    runs_dir = base / f"runs-{user}"
    runs_dir.mkdir()
    runs_dir.chmod(0o777)
    secret = secrets.token_hex(16)
    report = _run_suite(user, config, runs_dir, secret)
    marker, checkpoint = config["marker"], Path(config["checkpoint"])
    out = {name: case["stdout"] for name, case in report["cases"].items()}
    cases = report["cases"]
    assert {case["isolation"] for case in cases.values()} == {BWRAP}
    assert all(case["left"] == [] for case in cases.values()), cases  # no process of any run left
    assert "ran" in out["hook_off_subprocess"], cases["hook_off_subprocess"]  # the hook was really off
    assert out["write_tmp_and_shm"].count("ok ") == 2  # inside its own tmpfs ...
    assert "ok " not in out["write_checkpoint"] + out["sqlite_outside"]  # ... and nowhere else
    assert "refused remove FileNotFoundError" in out["tmp_ray"]  # the host's /tmp is not its /tmp
    assert "refused tcp PermissionError" in out["tcp_loopback"] and "refused unix PermissionError" in out["unix_socket"]
    for server in (unix, tcp):
        with pytest.raises(BlockingIOError):  # not even a connection queued
            server.accept()
    assert secret not in out["parent_proc"] and str(ROOT) not in out["parent_proc"]
    assert out["parent_proc"].startswith("pids [1, 2]"), out["parent_proc"]  # bwrap's init and itself
    # its parent's pid names no process in its PID namespace; 1 (bwrap's init) and -1 reach only that namespace
    assert f"refused kill {report['_parent']} ProcessLookupError" in out["kill_parent"], out["kill_parent"]
    assert all(line.split()[2:] == ["-1", "1"] for line in out["ptrace_parent"].splitlines()), out  # EPERM
    assert cases["fork_bomb"]["status"] == "passed" and cases["double_fork_orphan"]["status"] == "passed"
    assert max(case["seconds"] for case in cases.values()) < 5
    # nothing on disk: the host's targets as they were, the sandboxes' output directories removed
    assert sorted(p.name for p in checkpoint.iterdir()) == ["keep.txt", "sock"]
    assert [p.name for p in Path(config["ray"]).iterdir()] == ["keep.txt"]
    assert not [p for p in (Path("/tmp"), Path("/dev/shm")) if any(marker in q.name for q in p.iterdir())]
    assert list(runs_dir.iterdir()) == []


def test_killing_bwrap_takes_every_process_of_the_sandbox_down(bwrap_works):
    """The wall-clock timeout's kill alone, without run_python's cleanup after it: SIGKILL to bwrap's process group
    ends the sandbox's PID namespace, an orphan that left its session included."""
    marker = f"rlhfkit-escape-{secrets.token_hex(4)}"
    orphan = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n"
              "    os._exit(0)\ntime.sleep(60)\n")
    uid = (1 << 20) + 11 if os.geteuid() == 0 else None
    with seccomp_file() as filt:
        argv = bwrap_argv(shutil.which("bwrap") or "bwrap", sandbox_python(), filt.fileno(), None, 1 << 20)
        proc = subprocess.Popen(argv + ["-I", "-c", orphan, marker], pass_fds=(filt.fileno(),), start_new_session=True,
                                env={"PATH": "/usr/bin:/bin"}, user=uid, group=uid, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while len(_programs(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_programs(marker)) == 2  # the program and its orphaned grandchild (the child between: a zombie)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 2
        while processes_of_run(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert processes_of_run(marker) == []
    finally:  # a failed test leaves nothing either
        for pid in processes_of_run(marker):
            os.kill(pid, signal.SIGKILL)
        proc.wait()

def _programs(marker: str) -> list[int]:
    """The sandboxed processes carrying `marker`, bwrap's own two left out."""
    pids = []
    for pid in processes_of_run(marker):
        try:
            if not Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].endswith(b"bwrap"):
                pids.append(pid)
        except OSError:
            continue
    return pids
