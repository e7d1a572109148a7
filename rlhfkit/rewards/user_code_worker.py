"""The worker side of the user-code pool (rlhfkit/rewards/user_code.py): the loop that runs in each worker process.

This file is loaded by path in a plain `python -c` subprocess, without importing rlhfkit's package, so that a worker
starts in ~50 ms; it imports nothing from rlhfkit. It imports the user's file, then serves calls `(name, args,
kwargs)` over a socket pair until the parent closes it or goes away.
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ALIASES_ENV = "RLHFKIT_IMPORT_ALIASES"


def describe(e: BaseException) -> str:
    """`ValueError: first line of the message` (the type alone when the message is empty)."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def send_obj(conn: Connection, obj: Any) -> None:
    # Plain pickle, not Connection.send's ForkingPickler: with torch imported, that one would pass tensors as
    # shared-memory handles through a resource-sharer server instead of by value.
    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv_obj(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


@contextmanager
def aliased_imports(aliases: dict[str, str]) -> Iterator[None]:
    """While the block runs, importing a name of `aliases` ("openrlhf.utils.agent") gives the module it maps to
    ("rlhfkit.agents.api"), and its parent packages exist (empty: other submodules of them are not found). On exit
    `sys.modules` holds again what it held before for each of those names: a real package of that name, imported or
    not, is never shadowed outside the block, and none of it is imported inside."""
    import importlib
    import types

    saved: dict[str, Any] = {}
    made: set[str] = set()
    try:
        for name, target in aliases.items():
            parts = name.split(".")
            for i in range(1, len(parts)):  # the parent packages: empty, for the block only
                sub = ".".join(parts[:i])
                if sub not in made:
                    saved.setdefault(sub, sys.modules.get(sub))
                    package = types.ModuleType(sub)
                    package.__path__ = []  # no submodules of its own: `import openrlhf.x` is not found
                    sys.modules[sub] = package
                    made.add(sub)
            saved.setdefault(name, sys.modules.get(name))
            sys.modules[name] = importlib.import_module(target)
            for i in range(1, len(parts)):  # each package's attribute names its child, as after an import
                setattr(sys.modules[".".join(parts[:i])], parts[i], sys.modules[".".join(parts[:i + 1])])
        yield
    finally:
        for sub, old in saved.items():
            if old is None:
                sys.modules.pop(sub, None)
            else:
                sys.modules[sub] = old


def import_aliases_from_env() -> dict[str, str]:
    """The aliases the pool passes to its workers (RLHFKIT_IMPORT_ALIASES: JSON {name: target})."""
    import json

    return dict(json.loads(os.environ.get(ALIASES_ENV) or "{}"))


def _load_module(path: str) -> Any:
    import importlib.util

    sys.path.insert(0, str(Path(path).resolve().parent))  # the file may import its neighbours, as a script would
    spec = importlib.util.spec_from_file_location("rlhfkit_user_code", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules["rlhfkit_user_code"] = module
    with aliased_imports(import_aliases_from_env()):
        spec.loader.exec_module(module)
    return module


def _run(fn: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    import inspect

    value = fn(*args, **kwargs)
    if inspect.isawaitable(value):  # an `async def` function: run it to completion here
        import asyncio

        async def wait() -> Any:
            return await value

        value = asyncio.run(wait())
    return value


def _new(cls: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """`cls(*args, **kwargs)`, awaiting an `async def __init__`."""
    import inspect

    if inspect.iscoroutinefunction(cls.__init__):
        obj = cls.__new__(cls)
        _run(cls.__init__, (obj, *args), kwargs)
        return obj
    return cls(*args, **kwargs)


def _object_call(module: Any, objects: dict[str, Any], name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """Objects that live in the worker between calls (PinnedWorkers): "new:<Class>:<key>" builds one (awaiting an
    `async def __init__`), "call:<key>:<method>" calls a method, "drop:<key>" forgets it, "once:<Class>:<method>"
    builds one, sets attributes, calls one method and forgets it (one call: nothing outlives the worker's death)."""
    op, _, rest = name.partition(":")
    if op == "new":
        class_name, _, key = rest.partition(":")
        objects[key] = _new(getattr(module, class_name), args, kwargs)
        return None
    if op == "once":  # "once:<Class>:<method>", args (attributes, *method args): build, set, call, forget
        class_name, _, method = rest.partition(":")
        obj = _new(getattr(module, class_name), (), {})
        for attr, value in dict(args[0]).items():
            setattr(obj, attr, value)
        return _run(getattr(obj, method), args[1:], kwargs)
    if op == "call":
        key, _, method = rest.partition(":")
        return _run(getattr(objects[key], method), args, kwargs)
    if op == "drop":
        objects.pop(rest, None)
        return None
    raise ValueError(f"unknown object operation {name!r}")


def worker_main(fd: int, path: str) -> None:
    """Serve calls `(name, args, kwargs)` -> `("ok", value)` | `("error", text)` until the parent closes."""
    import threading

    conn = Connection(fd)
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        module = _load_module(path)
    except BaseException as e:  # noqa: BLE001 - any failure while importing is the user's file
        send_obj(conn, ("load_error", describe(e)))
        return
    try:
        send_obj(conn, ("ready", sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))))
    except OSError:  # the pool closed before this worker was needed
        return
    objects: dict[str, Any] = {}
    while True:
        try:
            name, args, kwargs = recv_obj(conn)
        except (EOFError, OSError):
            return
        try:
            if ":" in name:
                reply = ("ok", _object_call(module, objects, name, args, kwargs))
            else:
                reply = ("ok", _run(getattr(module, name), args, kwargs))
        except BaseException as e:  # noqa: BLE001 - SystemExit too: the user's code must not end the worker
            reply = ("error", describe(e))
        try:
            send_obj(conn, reply)  # pickles first, so a failure here writes nothing
        except Exception as e:  # noqa: BLE001
            send_obj(conn, ("bad_output", f"the return value cannot be sent back ({describe(e)})"))
