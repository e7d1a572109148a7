"""The bubblewrap command line of the code sandbox, and the check that bubblewrap works on this machine.

`bwrap_argv` puts a program into new user, PID, mount, network, IPC, UTS and cgroup namespaces (`--unshare-all`,
with `--disable-userns` so that it cannot nest one of its own), on a read-only view of the root file system where
/tmp and /dev/shm are small private tmpfs (its working directory is /tmp/work) and the caller's home and /run
are empty, with a fresh /proc of its own PID namespace (no other process, the parent included, is visible), a
minimal /dev, no capabilities, a new terminal session, the seccomp filter of `sandbox_seccomp`, and
`--die-with-parent`: when the bwrap process is killed, the namespace's first process dies and the kernel kills every
process left in the namespace.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rlhfkit.rewards.sandbox_seccomp import ARCHITECTURES, build_filter

WORKDIR = "/tmp/work"  # inside the sandbox: a directory of its /tmp, so that the audit hook's "inside" is narrow
HIDDEN_SIZE = 1 << 20  # the emptied directories (home, /run) are tmpfs too: writable, but tiny


def hidden_dirs() -> list[str]:
    """Directories the program must not read: the caller's home (tokens, ~/.netrc, SSH keys) and /run (secrets of
    containers, runtime sockets). Other places stay readable, read-only (checkpoints are readable, not writable)."""
    dirs = ["/run"]
    home = os.path.realpath(Path.home())
    if home != "/" and os.path.isdir(home):
        dirs.insert(0, home)
    return [d for d in dirs if os.path.isdir(d)]


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def hidden_and_shown(python: str) -> tuple[list[str], list[str]]:
    """The directories to empty, and those of the interpreter to show again (read-only) inside an emptied one: a
    pyenv or a venv's base Python under $HOME. The interpreter needs its own directory and, when it is ours, its
    base prefix (standard library, libpython). A directory to empty that lies inside such a prefix (a home under
    /usr) is left alone: showing the prefix again would show it anyway."""
    real = os.path.realpath(python)
    needed = [os.path.dirname(real)]
    if real == os.path.realpath(sys.executable):
        needed.append(os.path.realpath(sys.base_prefix))
    hidden = [d for d in hidden_dirs() if not any(_inside(d, p) for p in needed)]
    shown = [p for p in dict.fromkeys(needed) if any(_inside(p, d) for d in hidden)]
    return hidden, shown


@functools.lru_cache(maxsize=4)
def bwrap_options(bwrap: str) -> frozenset[str]:
    """The options this bwrap knows (`--help`): `--disable-userns` came with 0.8.0, `--size` with 0.5.0."""
    try:
        done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return frozenset(word for word in (done.stdout + done.stderr).split() if word.startswith("--"))


def bwrap_argv(bwrap: str, python: str, seccomp_fd: int, program_fd: int | None, disk_bytes: int) -> list[str]:
    """The bwrap arguments up to the command: `python` (a real path) then runs with cwd /tmp/work; `program_fd`, when
    given, is copied to /tmp/work/program.py. An older bwrap without `--disable-userns` leaves that to the seccomp
    filter (which refuses new user namespaces too); one without `--size` gives tmpfs bounded only by RLIMIT_FSIZE
    per file."""
    options = bwrap_options(bwrap)
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--hostname", "sandbox", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
    if "--disable-userns" in options:
        argv.insert(3, "--disable-userns")

    def tmpfs(directory: str, size: int) -> list[str]:
        return (["--size", str(size)] if "--size" in options else []) + ["--tmpfs", directory]

    hidden, shown = hidden_and_shown(python)
    for directory in hidden:
        argv += tmpfs(directory, HIDDEN_SIZE)
    for directory in shown:
        argv += ["--ro-bind", directory, directory]
    for directory in ("/tmp", "/dev/shm"):
        argv += tmpfs(directory, disk_bytes)
    argv += ["--dir", WORKDIR]
    if program_fd is not None:
        argv += ["--file", str(program_fd), f"{WORKDIR}/program.py"]
    return argv + ["--chdir", WORKDIR, "--seccomp", str(seccomp_fd), os.path.realpath(python)]


def seccomp_file() -> tempfile._TemporaryFileWrapper:
    """The compiled filter in an unlinked file, rewound: pass its descriptor to bwrap (`pass_fds`)."""
    f = tempfile.TemporaryFile()
    f.write(build_filter())
    f.flush()
    f.seek(0)
    return f  # type: ignore[return-value]


def bwrap_problem(python: str, uid: int | None) -> str | None:
    """Why bubblewrap cannot sandbox code here (not installed, an unknown machine, namespaces refused by the kernel),
    or None: a trial run of `python -c pass` under the full command line, as `uid` when given (we are root)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed"
    if platform.machine() not in ARCHITECTURES:
        return f"the sandbox has no seccomp filter for {platform.machine()} (known: {', '.join(ARCHITECTURES)})"
    with seccomp_file() as filt:
        argv = bwrap_argv(bwrap, python, filt.fileno(), None, 1 << 20) + ["-I", "-c", "pass"]
        try:
            done = subprocess.run(argv, pass_fds=(filt.fileno(),), capture_output=True, timeout=30,
                                  env={"PATH": "/usr/bin:/bin"}, user=uid, group=uid,
                                  extra_groups=[] if uid is not None else None)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap did not start ({e})"
    if done.returncode != 0:
        lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return f"bwrap failed: {lines[-1] if lines else f'exit code {done.returncode}'}"
    return None


@functools.lru_cache(maxsize=4)
def cached_bwrap_problem(python: str, as_root: bool) -> str | None:
    """`bwrap_problem`, tried once per process (as an unused uid when we are root, as the sandbox runs)."""
    return bwrap_problem(python, (1 << 20) + 7 if as_root else None)
