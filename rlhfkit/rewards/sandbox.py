"""Run untrusted Python (a model's code completion) in a subprocess sandbox, for code rewards.

`run_python(program)` writes the program into a fresh temporary directory and runs it there with:
- resource limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), open files, file size (RLIMIT_FSIZE, which
  also bounds its captured output), no core dumps, and a process count (RLIMIT_NPROC);
- its own user id when we are root: RLIMIT_NPROC is not enforced for root, so the child drops to a uid of its
  own (random, in 2^20..2^30, never a real account) with no groups. The uid makes RLIMIT_NPROC a per-run budget
  and lets the cleanup find every process the program started, even one that left its session;
- no network: a fresh network namespace (unshare(CLONE_NEWNET), only loopback, down) where the kernel allows it,
  and in every case a Python audit hook that refuses sockets;
- its directory only: the audit hook refuses opening files for writing, creating, removing or renaming outside
  the directory, starting programs (exec, subprocess, os.system: they would escape the hook) and ctypes (which
  could call libc around it); forking stays allowed, bounded by RLIMIT_NPROC;
- a wall-clock timeout, after which its whole session, and (as root) every process of its uid, is killed; the
  same cleanup runs after every run, so nothing it started outlives it. The directory is removed.
The audit hook is defense in depth for a Python program, not a security boundary against a determined attacker;
the uid, the limits and the namespace are the kernel's.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PASSED, FAILED, TIMEOUT = "passed", "failed", "timeout"


@dataclass
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    processes: int = 32
    file_bytes: int = 16 << 20
    open_files: int = 64


@dataclass
class SandboxResult:
    status: str  # passed (exit 0), failed (non-zero exit, an exception), timeout (wall clock or CPU limit)
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    uid: int  # the uid the program ran as
    network: str  # how the network was cut: "namespace+audit" or "audit"

    @property
    def passed(self) -> bool:
        return self.status == PASSED


# Runs in the child before the program: namespace, limits, uid, audit hook; then the program itself.
_BOOT = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
network = "audit"
try:
    import ctypes
    if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) == 0:  # CLONE_NEWNET
        network = "namespace+audit"
except Exception:
    pass
R = resource
for limit, value in ((R.RLIMIT_CPU, (cfg["cpu_seconds"], cfg["cpu_seconds"] + 1)), (R.RLIMIT_CORE, (0, 0)),
                     (R.RLIMIT_AS, (cfg["memory_bytes"],) * 2), (R.RLIMIT_FSIZE, (cfg["file_bytes"],) * 2),
                     (R.RLIMIT_NOFILE, (cfg["open_files"],) * 2)):
    resource.setrlimit(limit, value)
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
resource.setrlimit(R.RLIMIT_NPROC, (cfg["processes"],) * 2)
sys.stderr.write(f"sandbox: uid {os.getuid()}, network {network}\n")
ROOT = os.path.realpath(os.getcwd())
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.chown",
               "os.truncate", "os.utime", "os.chdir", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
               "shutil.copytree", "shutil.move", "shutil.rmtree", "shutil.chown"}
REFUSED = ("socket.", "subprocess.", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile",
           "ctypes.", "mmap.", "os.fwalk", "pty.", "os.forkpty")


def inside(path):
    if isinstance(path, int):
        return True  # an already open descriptor
    try:
        full = os.path.realpath(os.path.join(ROOT, os.fsdecode(path)))
    except (TypeError, ValueError):
        return False
    return full == ROOT or full.startswith(ROOT + os.sep)


def audit(event, args):
    if event == "open":
        path, mode, flags = args
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & WRITE_FLAGS)
        if writes and not inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside its directory is not allowed")
    elif event in PATH_EVENTS:
        for path in args[:2]:
            if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                raise PermissionError(f"sandbox: {event} on {path!r} outside its directory is not allowed")
    elif event.startswith(REFUSED):
        raise PermissionError(f"sandbox: {event} is not allowed")


sys.addaudithook(audit)
del ctypes
source = open("program.py").read()
namespace = {"__name__": "__main__", "__file__": "program.py"}
exec(compile(source, "program.py", "exec"), namespace)
'''


def _processes_of(uid: int) -> list[int]:
    """Live processes (zombies left out: they hold nothing but a pid) whose real uid is `uid`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
            if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
                pids.append(int(entry.name))
        except (OSError, ValueError, KeyError):
            continue
    return pids


def _world_usable(path: Path) -> bool:
    """Every directory up to `path` can be entered by anyone, and `path` itself read."""
    try:
        path = path.resolve()
        return bool(path.stat().st_mode & 0o004) and all(d.stat().st_mode & 0o001 for d in path.parents)
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def sandbox_python() -> str:
    """The interpreter for sandboxed programs: ours when another uid can read it and its standard library (a
    Python under /root, e.g. pyenv's, is not), else the system's python3. Sandboxed code needs only the stdlib."""
    if os.geteuid() != 0:
        return sys.executable
    ours = Path(sysconfig.get_path("stdlib"))
    if _world_usable(Path(sys.executable)) and _world_usable(ours / "os.py"):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        binary = Path(candidate)
        if binary.exists() and _world_usable(binary):
            return candidate
    return sys.executable


def _kill_everything(session: int, uid: int | None) -> None:
    """SIGKILL the program's session and, when it ran under a uid of its own, every process of that uid (a
    process that called setsid has left the session; a fork bomb keeps spawning until its budget is spent)."""
    try:
        os.killpg(session, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if uid is None:
        return
    time.sleep(0.01)
    for _ in range(100):
        pids = _processes_of(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


def _read_head(path: Path, limit: int = 4096) -> str:
    try:
        with path.open("rb") as f:
            return f.read(limit).decode("utf-8", "replace")
    except OSError:
        return ""


def sandbox_uid() -> int:
    """A uid no account uses, new for every run (2^20..2^30, inside the usual 32-bit uid range)."""
    return random.SystemRandom().randrange(1 << 20, 1 << 30)


def run_python(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `program` (Python source) in the sandbox; the result says how it ended and what it printed."""
    limits = limits or SandboxLimits()
    as_root = os.geteuid() == 0
    uid = sandbox_uid() if as_root else os.getuid()
    workdir = Path(tempfile.mkdtemp(prefix="rlhfkit-sandbox-"))
    try:
        (workdir / "program.py").write_text(program)
        if as_root:
            for path in (workdir, workdir / "program.py"):
                os.chown(path, uid, uid)
        workdir.chmod(0o700)
        cfg = {**asdict(limits), "uid": uid}
        if not as_root:  # RLIMIT_NPROC counts all of this user's processes: leave room for the ones running
            cfg["processes"] = limits.processes + len(_processes_of(uid))
        env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"}
        started = time.perf_counter()
        with (workdir / ".stdout").open("wb") as out, (workdir / ".stderr").open("wb") as err:
            proc = subprocess.Popen([sandbox_python(), "-I", "-B", "-c", _BOOT, json.dumps(cfg)], cwd=workdir,
                                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()  # reap it, so that only the processes it left behind are still found below
            _kill_everything(proc.pid, uid if as_root else None)
        seconds = time.perf_counter() - started
        code = proc.returncode
        cpu_killed = code in (-signal.SIGXCPU, -signal.SIGKILL) and not timed_out
        status = TIMEOUT if timed_out or cpu_killed else (PASSED if code == 0 else FAILED)
        stderr = _read_head(workdir / ".stderr")
        first, _, rest = stderr.partition("\n")
        network = first.rsplit("network ", 1)[-1] if first.startswith("sandbox: uid") else "unknown"
        return SandboxResult(status=status, returncode=code, stdout=_read_head(workdir / ".stdout"),
                             stderr=rest if first.startswith("sandbox: uid") else stderr, seconds=seconds, uid=uid,
                             network=network)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
