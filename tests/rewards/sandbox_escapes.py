"""The sandbox escape programs, run by test_sandbox_escape.py in a process of its own (as root, and as uid 65534).

`python sandbox_escapes.py CONFIG_JSON` runs each case of ESCAPES through `run_python` and prints one JSON object:
case -> status, stdout, stderr and the processes of the run still alive afterwards. The config names the targets on
the host: `checkpoint` (a 0777 directory on the read-only root, with a file `keep.txt` and a 0777 Unix socket
`sock`), `ray` (a 0777 /tmp/ray-like directory with `keep.txt`), `port` (a 127.0.0.1 listener), `marker` (a name for
files). This process is the sandbox's parent: its command line and environment carry a secret that no case may read.
Every case first switches the audit hook off (the boot script's globals are the caller's frame), so that what holds
is the OS boundary alone.
"""

from __future__ import annotations

import json
import os
import sys

HOOK_OFF = """import sys
_boot = sys._getframe(1).f_globals
_boot["REFUSED"] = ("\\0",); _boot["PATH_EVENTS"] = set(); _boot["inside"] = lambda path: True
def attempt(what, action):
    try:
        action()
        print("ok", what, flush=True)
    except Exception as e:
        print("refused", what, type(e).__name__, e, flush=True)
"""

ESCAPES = {
    # the hook is off: a program starts; whatever it writes stays inside
    "hook_off_subprocess": """import subprocess
print(subprocess.run(["sh", "-c", "echo ran; echo x > {checkpoint}/{marker}.sub; echo x > /tmp/{marker}.sub"],
                     capture_output=True, text=True).stdout, flush=True)
""",
    "write_tmp_and_shm": """
for path in ("/tmp/{marker}", "/dev/shm/{marker}"):
    attempt(path, lambda: open(path, "w").write("x"))
""",
    "write_checkpoint": """import os
attempt("write", lambda: open("{checkpoint}/{marker}", "w").write("x"))
attempt("remove", lambda: os.remove("{checkpoint}/keep.txt"))
""",
    "tmp_ray": """import os
attempt("remove", lambda: os.remove("{ray}/keep.txt"))
attempt("write", lambda: (os.makedirs("{ray}", exist_ok=True), open("{ray}/{marker}", "w").write("x")))
""",
    "sqlite_outside": """import sqlite3
attempt("sqlite", lambda: sqlite3.connect("{checkpoint}/{marker}.db").execute("create table t (x)"))
""",
    "tcp_loopback": """import socket
attempt("tcp", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2).sendall(b"x"))
""",
    "unix_socket": """import socket
def connect():
    s = socket.socket(socket.AF_UNIX)
    s.connect("{checkpoint}/sock")
    s.sendall(b"x")
attempt("unix", connect)
""",
    "parent_proc": """import os
print("pids", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), flush=True)
for pid in sorted({{{parent}, os.getppid(), 1}} | {{int(p) for p in os.listdir("/proc") if p.isdigit()}}):
    for name in ("environ", "cmdline"):
        attempt(f"/proc/{{pid}}/{{name}}", lambda: print(open(f"/proc/{{pid}}/{{name}}", "rb").read(), flush=True))
""",
    "kill_parent": """import os, signal
for pid in ({parent}, os.getppid(), 1, -1):
    attempt(f"kill {{pid}}", lambda: os.kill(pid, signal.SIGKILL))
""",
    "ptrace_parent": """import ctypes
libc = ctypes.CDLL(None, use_errno=True)
for pid in ({parent}, 1):
    result = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
    print("ptrace", pid, result, ctypes.get_errno(), flush=True)
""",
    "fork_bomb": """import os, time
started, forks = time.monotonic(), 0
while time.monotonic() - started < 1.0:
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forks += 1
    except OSError:
        pass
print("forked", forks, flush=True)
""",
    "double_fork_orphan": """import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(1.5)
        open("{checkpoint}/{marker}.orphan", "w").write("x")
        os._exit(0)
    os._exit(0)
time.sleep(0.2)
print("parent leaves", flush=True)
""",
}


def main() -> None:
    from rlhfkit.rewards.sandbox import SandboxLimits, processes_of_run, run_python

    config = json.loads(sys.argv[1])
    values = {**config, "parent": os.getpid()}
    limits = SandboxLimits(wall_seconds=6.0, cpu_seconds=3, processes=16)
    report = {}
    for name, body in ESCAPES.items():
        result = run_python(HOOK_OFF + body.format(**values), limits)
        report[name] = {"status": result.status, "stdout": result.stdout, "stderr": result.stderr[-2000:],
                        "seconds": result.seconds, "isolation": result.isolation,
                        "left": processes_of_run(result.run_id)}
    print(json.dumps({"_parent": os.getpid(), "cases": report}))


if __name__ == "__main__":
    main()
