"""User code in worker processes: an exception, a hang or a crash in a user's file costs one call, not the run.

A `UserCodePool` imports one Python file (a `reward_func` file, an agent) in each of N worker processes and calls
its functions there, each call with a timeout. A call ends in a `CallResult`: the value, or one failure kind:
- `exception`: the function raised (also `SystemExit`); the worker lives on;
- `timeout`: no answer within the timeout; the worker's whole process session is killed and replaced;
- `crash`: the worker died (`os._exit`, a segfault, the OOM killer); it is replaced;
- `bad_output`: the value could not be sent back (not picklable).
The caller decides what a failure costs (rlhfkit.rewards.sources gives the call's samples a fallback reward).

Workers are plain subprocesses (`python -c`), not `multiprocessing` children: they start in ~50 ms without
importing rlhfkit's package (user_code_worker.py is loaded by path), each in its own session so that a kill takes
the user code's own children with it, and they talk over a socket pair that the user's prints cannot corrupt. A
worker exits when its parent goes away (a watchdog thread), so a killed trainer leaves no worker behind.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Pipe
from pathlib import Path
from typing import Any

from rlhfkit.rewards.user_code_worker import ALIASES_ENV, describe, recv_obj, send_obj

WORKER_FILE = Path(__file__).with_name("user_code_worker.py")
FAILURE_KINDS = ("exception", "timeout", "crash", "bad_output")

# The worker bootstrap: load user_code_worker.py by path (no package import) and serve.
_BOOT = ("import sys, importlib.util as u; s = u.spec_from_file_location('rlhfkit_user_code_worker', sys.argv[1]); "
         "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); "
         "m.worker_main(int(sys.argv[2]), sys.argv[3])")


@dataclass
class CallResult:
    """What one call returned, or how it failed (`kind` in FAILURE_KINDS, `error` one line)."""

    value: Any = None
    kind: str | None = None
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.kind is None


class UserCodeLoadError(Exception):
    """The user's file could not be imported in a worker (message: the exception's first line)."""


# -- the parent side --------------------------------------------------------------------------------------
def _exit_text(code: int | None) -> str:
    if code is None:
        return "the worker stopped answering"
    if code < 0:
        try:
            return f"the worker died (signal {signal.Signals(-code).name})"
        except ValueError:
            return f"the worker died (signal {-code})"
    return f"the worker exited (exit code {code})"


class _Worker:
    """One worker process and its end of the socket pair."""

    def __init__(self, path: str, env: dict[str, str]):
        ours, theirs = Pipe(duplex=True)
        self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(WORKER_FILE), str(theirs.fileno()), path],
                                     pass_fds=(theirs.fileno(),), start_new_session=True, env=env,
                                     stdin=subprocess.DEVNULL)
        theirs.close()
        self.conn = ours
        self.functions: list[str] | None = None
        self.alive = True

    def wait_ready(self, timeout: float) -> list[str]:
        """The file's public callables once it is imported; UserCodeLoadError when the import fails."""
        if self.functions is not None:
            return self.functions
        if not self.conn.poll(timeout):
            self.kill()
            raise UserCodeLoadError(f"importing it took more than {timeout:g} s")
        try:
            status, payload = recv_obj(self.conn)
        except (EOFError, OSError):
            self.kill()
            raise UserCodeLoadError(f"importing it killed the worker ({_exit_text(self.proc.poll())})") from None
        if status != "ready":
            self.kill()
            raise UserCodeLoadError(payload)
        self.functions = payload
        return payload

    def call(self, name: str, args: Sequence[Any], kwargs: dict[str, Any], timeout: float,
             start_timeout: float) -> CallResult:
        try:
            self.wait_ready(start_timeout)
        except UserCodeLoadError as e:
            return CallResult(kind="crash", error=f"a replacement worker failed to start ({e})")
        started = time.perf_counter()
        try:
            send_obj(self.conn, (name, tuple(args), dict(kwargs)))
        except (OSError, ValueError) as e:
            self.kill()
            return CallResult(kind="crash", error=f"the call could not be sent ({describe(e)})")
        if not self.conn.poll(timeout):
            self.kill()
            return CallResult(kind="timeout", error=f"{name} took more than {timeout:g} s (killed)",
                              seconds=time.perf_counter() - started)
        try:
            status, payload = recv_obj(self.conn)
        except (EOFError, OSError):
            code = self.kill()
            return CallResult(kind="crash", error=f"{name}: {_exit_text(code)}", seconds=time.perf_counter() - started)
        except Exception as e:  # noqa: BLE001 - e.g. an instance of a class only the user's file defines
            return CallResult(kind="bad_output", error=f"{name}: its return value cannot be read here ({describe(e)})",
                              seconds=time.perf_counter() - started)
        seconds = time.perf_counter() - started
        if status == "ok":
            return CallResult(value=payload, seconds=seconds)
        if status == "error":
            return CallResult(kind="exception", error=f"{name} raised {payload}", seconds=seconds)
        return CallResult(kind="bad_output", error=f"{name}: {payload}", seconds=seconds)

    def kill(self) -> int | None:
        """Kill the worker's whole session (the user's code may have started children); its exit code."""
        self.alive = False
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        self.conn.close()
        # A natural death (os._exit, a signal) reports its own code; our SIGKILL would read as -9.
        return code

    def close(self) -> None:
        """Let the worker end on its own (end of input), then make sure its session is gone."""
        try:
            self.conn.close()
            self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        self.kill()


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The file may import rlhfkit (e.g. `from rlhfkit.agents import ...`): the same rlhfkit as ours.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


class UserCodePool:
    """N workers that each imported `path`; `call`/`map` run its functions there with a timeout per call."""

    def __init__(self, path: str, workers: int = 1, timeout: float = 60.0, start_timeout: float = 120.0):
        if workers < 1 or timeout <= 0 or start_timeout <= 0:
            raise ValueError(f"UserCodePool needs workers >= 1 and positive timeouts (got {workers}, {timeout}, "
                             f"{start_timeout})")
        self.path = str(Path(path).expanduser().resolve())
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self.replaced = 0
        self._env = _worker_env()
        started = [_Worker(self.path, self._env) for _ in range(workers)]
        try:
            self.functions = set(started[0].wait_ready(self.start_timeout))
            for w in started[1:]:
                w.wait_ready(self.start_timeout)
        except UserCodeLoadError:
            for w in started:
                w.kill()
            raise
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for w in started:
            self._idle.put(w)
        self.size = workers
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="user-code")
        self._closed = False

    def call(self, name: str, *args: Any, **kwargs: Any) -> CallResult:
        """Run `name(*args, **kwargs)` in an idle worker (waiting for one); a dead worker is replaced."""
        if self._closed:
            raise RuntimeError("UserCodePool is closed")
        worker = self._idle.get()
        try:
            return worker.call(name, args, kwargs, self.timeout, self.start_timeout)
        finally:
            if not worker.alive:
                self.replaced += 1
                worker = _Worker(self.path, self._env)  # starts now; its import overlaps with other calls
            self._idle.put(worker)

    def map(self, name: str, calls: Sequence[Sequence[Any]],
            kwargs: Sequence[dict[str, Any]] | None = None) -> list[CallResult]:
        """`name(*args, **kw)` for every args tuple (and its `kwargs` entry, if given), on all workers at once;
        results in order."""
        each = kwargs if kwargs is not None else [{}] * len(calls)
        futures = [self._threads.submit(self.call, name, *args, **kw) for args, kw in zip(calls, each)]
        return [f.result() for f in futures]

    def worker_pids(self) -> list[int]:
        """Process ids of the idle workers (for tests and diagnostics)."""
        return [w.proc.pid for w in list(self._idle.queue)]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        while not self._idle.empty():
            self._idle.get_nowait().close()

    def __enter__(self) -> UserCodePool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class PinnedWorkers:
    """N workers of one file where the caller picks the worker, for objects that keep state in a worker between
    calls (an agent episode's AgentInstance): `new`, `call`, `drop` on a key pinned to worker `key_index`. A worker
    that dies (crash, or killed at a timeout) is replaced; the objects it held are gone, and calls on them fail."""

    def __init__(self, path: str, workers: int = 1, timeout: float = 60.0, start_timeout: float = 120.0,
                 import_aliases: dict[str, str] | None = None):
        if workers < 1 or timeout <= 0:
            raise ValueError(f"PinnedWorkers needs workers >= 1 and a positive timeout (got {workers}, {timeout})")
        self.path = str(Path(path).expanduser().resolve())
        self.timeout, self.start_timeout = float(timeout), float(start_timeout)
        self._env = _worker_env()
        if import_aliases:  # names the file imports that mean other modules (user_code_worker.aliased_imports)
            self._env[ALIASES_ENV] = json.dumps(import_aliases)
        self._workers = [_Worker(self.path, self._env) for _ in range(workers)]
        try:
            self.functions = set(self._workers[0].wait_ready(self.start_timeout))
            for w in self._workers[1:]:
                w.wait_ready(self.start_timeout)
        except UserCodeLoadError:
            for w in self._workers:
                w.kill()
            raise
        import threading

        self._locks = [threading.Lock() for _ in range(workers)]
        self._births = [0] * workers  # how often each slot's worker was replaced
        self._homes: dict[str, tuple[int, int]] = {}  # key -> (slot, birth) where the object lives
        self._next = 0
        self._meta = threading.Lock()  # _next and _homes: calls come from several threads
        self.replaced = 0

    def _call_slot(self, slot: int, name: str, args: Sequence[Any], kwargs: dict[str, Any],
                   birth: int | None = None, home: str | None = None) -> CallResult:
        """Call in slot's worker; under the slot's lock (no race with a kill and replacement): with `birth`, refuse
        when the worker that held the object died since; with `home`, record that key's object lives there now."""
        with self._locks[slot]:
            if birth is not None and self._births[slot] != birth:
                return CallResult(kind="crash", error=f"{name}: the worker that held this object died earlier")
            if home is not None:
                with self._meta:
                    self._homes[home] = (slot, self._births[slot])
            worker = self._workers[slot]
            result = worker.call(name, args, kwargs, self.timeout, self.start_timeout)
            if not worker.alive:
                self._workers[slot] = _Worker(self.path, self._env)
                self._births[slot] += 1
                self.replaced += 1
            return result

    def new(self, class_name: str, key: str, *args: Any, **kwargs: Any) -> CallResult:
        with self._meta:
            slot = self._next % len(self._workers)
            self._next += 1
            self._homes[key] = (slot, self._births[slot])
        result = self._call_slot(slot, f"new:{class_name}:{key}", args, kwargs, home=key)
        result.error = result.error.replace(f"new:{class_name}:{key}", f"{class_name}()")
        return result

    def call(self, key: str, method: str, *args: Any, **kwargs: Any) -> CallResult:
        with self._meta:
            slot, birth = self._homes[key]
        result = self._call_slot(slot, f"call:{key}:{method}", args, kwargs, birth)
        result.error = result.error.replace(f"call:{key}:{method}", method)
        return result

    def once(self, class_name: str, method: str, attributes: dict[str, Any], *args: Any) -> CallResult:
        """Build `class_name()` in the next worker, set `attributes`, call `method(*args)`, forget the object."""
        with self._meta:
            slot = self._next % len(self._workers)
            self._next += 1
        result = self._call_slot(slot, f"once:{class_name}:{method}", (attributes, *args), {})
        result.error = result.error.replace(f"once:{class_name}:{method}", method)
        return result

    def drop(self, key: str) -> None:
        with self._meta:
            slot, birth = self._homes.pop(key, (None, None))
        if slot is not None and self._births[slot] == birth:
            self._call_slot(slot, f"drop:{key}", (), {})

    def close(self) -> None:
        for w in self._workers:
            w.close()
