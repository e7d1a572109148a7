"""Run untrusted Python (a model's code completion) in a sandbox, for code rewards and code tools.

`run_python(program)` runs the program under bubblewrap (`sandbox_bwrap.py`), an OS boundary that holds whether we
run as root or as an ordinary user:
- namespaces: user, PID, mount, network, IPC, UTS (`bwrap --unshare-all`); no user namespace of its own inside;
- files: a read-only root; /tmp (its working directory is /tmp/work) and /dev/shm are private tmpfs (`disk_bytes`
  each), gone with the run; the caller's home and /run are empty; so the parent's files, checkpoints, Ray's /tmp/ray and
  other runs' sandboxes are out of reach, `sqlite3` and subprocesses included;
- processes: a fresh /proc of its own PID namespace, so the parent is invisible (no /proc/<ppid>/environ or
  cmdline, no kill, no ptrace), a new terminal session, no capabilities;
- system calls: a seccomp filter (`sandbox_seccomp.py`) refuses every socket (no 127.0.0.1 listener, no Unix socket
  file), ptrace, io_uring, namespaces, mounts, bpf and the like;
- resource limits: CPU seconds (RLIMIT_CPU), address space (RLIMIT_AS), open files, file size (RLIMIT_FSIZE, which
  also bounds its captured output), no core dumps, a process count (RLIMIT_NPROC). As root the sandbox runs under
  a uid of its own (random, in 2^20..2^30, never a real account, no groups): the kernel does not apply RLIMIT_NPROC
  to root, and the cleanup can then find every process of the run by its uid;
- a wall-clock timeout, after which bwrap's process group is killed; `--die-with-parent` then takes the PID
  namespace and every process in it down (an orphaned double fork too). After every run, any process whose command
  line carries the run's id is killed as well, and the host directory of its output is removed.
A Python audit hook (no sockets, no program starts, no ctypes, no writes outside the working directory) stays as a
second layer: a program can switch it off, the boundary is the kernel's.

Where bubblewrap is missing, the machine unknown to the seccomp filter, or the kernel refuses the namespaces, code
execution refuses to start (`SandboxUnavailable`, one line) unless RLHFKIT_UNSAFE_CODE_EXECUTION=1 accepts the risk:
then the program runs with only the limits, its own uid when we are root, and the audit hook.
"""

from __future__ import annotations

import functools
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from rlhfkit.errors import UserError
from rlhfkit.rewards.sandbox_bwrap import WORKDIR, bwrap_argv, cached_bwrap_problem, seccomp_file

PASSED, FAILED, TIMEOUT = "passed", "failed", "timeout"
BWRAP, UNSAFE = "bwrap", "unsafe"  # SandboxResult.isolation
UNSAFE_ENV = "RLHFKIT_UNSAFE_CODE_EXECUTION"


class SandboxUnavailable(UserError):
    """This machine cannot isolate untrusted code and the risk was not accepted."""


@dataclass
class SandboxLimits:
    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 1 << 30
    processes: int = 32
    file_bytes: int = 16 << 20
    open_files: int = 64
    disk_bytes: int = 32 << 20  # each of its tmpfs (/tmp, /dev/shm): files live in memory, so keep them small


@dataclass
class SandboxResult:
    status: str  # passed (exit 0), failed (non-zero exit, an exception), timeout (wall clock or CPU limit)
    returncode: int | None  # the program's exit code; a signal's number is negative
    stdout: str
    stderr: str
    seconds: float
    uid: int  # the uid the program ran as (outside its user namespace)
    isolation: str  # "bwrap", or "unsafe" (RLHFKIT_UNSAFE_CODE_EXECUTION=1: limits and the audit hook only)
    run_id: str  # in the command line of every process of the run

    @property
    def passed(self) -> bool:
        return self.status == PASSED


# Runs in the child before the program (inside bwrap, or alone in the unsafe mode): limits and the audit hook; then
# the program itself. cfg["run"] is the run's id: it stays in the command line of every process the program forks,
# so that the cleanup can find one that escaped.
_BOOT = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
R = resource
for limit, value in ((R.RLIMIT_CPU, (cfg["cpu_seconds"], cfg["cpu_seconds"] + 1)), (R.RLIMIT_CORE, (0, 0)),
                     (R.RLIMIT_AS, (cfg["memory_bytes"],) * 2), (R.RLIMIT_FSIZE, (cfg["file_bytes"],) * 2),
                     (R.RLIMIT_NOFILE, (cfg["open_files"],) * 2)):
    resource.setrlimit(limit, value)
resource.setrlimit(R.RLIMIT_NPROC, (cfg["processes"],) * 2)
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


def processes_of_run(run_id: str) -> list[int]:
    """Processes whose command line carries `run_id` (every process a sandboxed program forked, unless it replaced
    its command line with exec)."""
    needle = run_id.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
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


@functools.lru_cache(maxsize=1)
def _warn_unsafe(problem: str) -> None:
    print(f"warning: {UNSAFE_ENV}=1: untrusted code runs without an OS sandbox ({problem}); only resource limits "
          f"and a Python audit hook hold it", file=sys.stderr)


def sandbox_problem() -> str | None:
    """Why bubblewrap cannot isolate code on this machine, or None (tried once per process)."""
    return cached_bwrap_problem(sandbox_python(), os.geteuid() == 0)


def isolation() -> str:
    """BWRAP when bubblewrap isolates code here; UNSAFE when it cannot and RLHFKIT_UNSAFE_CODE_EXECUTION=1 accepts
    that; else SandboxUnavailable with the reason. Reward files call it at import, to fail before a run starts."""
    problem = sandbox_problem()
    if problem is None:
        return BWRAP
    if os.environ.get(UNSAFE_ENV, "") == "1":
        _warn_unsafe(problem)
        return UNSAFE
    raise SandboxUnavailable(f"untrusted code cannot run here: {problem}; install bubblewrap (Debian/Ubuntu: "
                             f"apt-get install bubblewrap), or set {UNSAFE_ENV}=1 to accept running it with only "
                             f"resource limits and a Python audit hook, which the code can switch off")


def _kill_leftovers(session: int, run_id: str, uid: int | None) -> None:
    """SIGKILL bwrap's process group, then every process that carries the run's id or, when the run had a uid of
    its own, that uid (a process that left the session; a fork bomb keeps spawning until its budget is spent)."""
    try:
        os.killpg(session, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(100):
        pids = set(processes_of_run(run_id)) | set(_processes_of(uid) if uid is not None else [])
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
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


def _command(mode: str, workdir: Path, cfg: dict, program: IO[bytes], seccomp: IO[bytes]) -> tuple[list[str], dict]:
    """The command line and environment: the boot script under bwrap (the program copied into its tmpfs), or alone
    in `workdir` (UNSAFE)."""
    boot = [sandbox_python(), "-I", "-B", "-c", _BOOT, json.dumps(cfg)]
    if mode == UNSAFE:
        return boot, {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"}
    argv = bwrap_argv(shutil.which("bwrap") or "bwrap", boot[0], seccomp.fileno(), program.fileno(),
                      cfg["disk_bytes"])
    return argv + boot[1:], {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}


def _returncode(mode: str, code: int) -> int:
    """The program's exit code, a signal as its negative number: bwrap exits with 128 + the signal's number when
    its program died of one."""
    return -(code - 128) if mode == BWRAP and code > 128 else code


def _status(code: int, timed_out: bool) -> str:
    if timed_out or code in (-signal.SIGXCPU, -signal.SIGKILL):  # the wall clock, or the CPU limit (soft, hard)
        return TIMEOUT
    return PASSED if code == 0 else FAILED


def _start(argv: list[str], env: dict, cwd: str, uid: int | None, files: tuple[IO[bytes], ...]) -> subprocess.Popen:
    """Start the command in a session of its own (its process group is what a timeout kills), as `uid` when given
    (we are root); `files` = stdout, stderr, then the descriptors bwrap reads."""
    out, err, *passed = files
    return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                            start_new_session=True, pass_fds=tuple(f.fileno() for f in passed), user=uid, group=uid,
                            extra_groups=[] if uid is not None else None)


def run_python(program: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `program` (Python source) in the sandbox; the result says how it ended and what it printed.
    SandboxUnavailable when this machine cannot isolate it (see `isolation`)."""
    limits = limits or SandboxLimits()
    mode = isolation()
    as_root = os.geteuid() == 0
    uid = sandbox_uid() if as_root else os.getuid()
    run_id = f"rlhfkit-sandbox-run-{secrets.token_hex(8)}"
    workdir = Path(tempfile.mkdtemp(prefix="rlhfkit-sandbox-"))  # its output (and, UNSAFE, its program)
    try:
        (workdir / "program.py").write_text(program)
        cfg = {**asdict(limits), "run": run_id}
        if mode == UNSAFE and as_root:
            for path in (workdir, workdir / "program.py"):
                os.chown(path, uid, uid)
        elif mode == UNSAFE:  # RLIMIT_NPROC counts all of this user's processes: leave room for those running
            cfg["processes"] = limits.processes + len(_processes_of(uid))
        with ((workdir / ".stdout").open("wb") as out, (workdir / ".stderr").open("wb") as err,
              (workdir / "program.py").open("rb") as source, seccomp_file() as filt):
            argv, env = _command(mode, workdir, cfg, source, filt)
            started = time.perf_counter()
            proc = _start(argv, env, str(workdir) if mode == UNSAFE else "/", uid if as_root else None,
                          (out, err, source, filt))
            try:
                proc.wait(timeout=limits.wall_seconds)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            _kill_leftovers(proc.pid, run_id, None)
            proc.wait()  # reaped: only what it left behind can be found below
            _kill_leftovers(proc.pid, run_id, uid if as_root else None)
        code = _returncode(mode, proc.returncode)
        return SandboxResult(status=_status(code, timed_out), returncode=code,
                             stdout=_read_head(workdir / ".stdout"), stderr=_read_head(workdir / ".stderr"),
                             seconds=time.perf_counter() - started, uid=uid, isolation=mode, run_id=run_id)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
