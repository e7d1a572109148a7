"""The bearer token of rlhfkit's model servers (`serve_rm`, `serve_teacher`), stated once for both: which key a
server requires (its flag rule), the constant-time check of a request's `Authorization` header, and keeping a
client's key (`--teacher_api_key`) out of what a run records (its saved config, checkpoint metadata, W&B); and the
two commands' life from start to Ctrl-C / SIGTERM (`serve_until_stopped`).

It lives in the config layer, the first one, so that both servers (`rlhfkit.rewards.server`,
`rlhfkit.rl.teacher_server`) and their configs import it without importing each other or a web stack.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from rlhfkit.errors import UserError

#: Config fields that hold a server's bearer token: recorded as HIDDEN when set (`without_keys`).
KEY_FIELDS = frozenset({"teacher_api_key", "api_key"})
HIDDEN = "<hidden>"
#: The values of --use_wandb (OpenRLHF's form: the W&B API key itself) that are no key: any other one is hidden too.
WANDB_WORDS = ("offline", "true", "1", "yes")


def key_or_env(api_key: str | None, env: str) -> str | None:
    """`api_key` when non-empty, else the environment variable `env`, else None: an empty flag (an unset shell
    variable in a script) never switches auth off while the environment holds a key."""
    return api_key or os.environ.get(env) or None


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def server_api_key(command: str, api_key: str | None, no_auth: bool, env: str, need_key: bool) -> str | None:
    """The bearer token a server requires (None: none), from --api_key or `env`. --no_auth next to a key is refused
    (UserError); so is no key at all where `need_key` says the server must have one, unless --no_auth."""
    key = key_or_env(api_key, env)
    if no_auth and key:
        raise UserError(f"--no_auth contradicts the key in {'--api_key' if api_key else env}; drop one of them")
    if need_key and not no_auth and not key:
        raise UserError(f"{command} needs a bearer token: set --api_key or {env}, or pass --no_auth to serve "
                        "without one")
    return key


def authorized(authorization: str | None, api_key: str | None) -> bool:
    """True without a key, else for a request whose `Authorization` header is `Bearer <key>` (compared in constant
    time)."""
    if not api_key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def without_keys(config: dict[str, Any]) -> dict[str, Any]:
    """`config` (nested as `dataclasses.asdict` gives it) with every set KEY_FIELDS value, and a --use_wandb API
    key, replaced by HIDDEN: what a run writes down (rlhfkit_args.json, the checkpoint's config, W&B) never holds a
    key, and a resume with another key sees no change."""
    return {k: (HIDDEN if _is_key(k, v) else without_keys(v) if isinstance(v, dict) else v) for k, v in config.items()}


def _is_key(field: str, value: Any) -> bool:
    if field == "use_wandb":
        return isinstance(value, str) and value.strip().lower() not in WANDB_WORDS
    return field in KEY_FIELDS and bool(value)


class _Server(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=_Server)


def announce_ready(prog: str, name: str, url: str, detail: str, *, bearer: bool, no_auth: bool, reach: str) -> None:
    """A server command's ready line, "<name> server ready: <url> (<detail>, auth=bearer|off)", after a warning on
    stderr when --no_auth lets anyone who can reach `reach` use the model."""
    if no_auth:
        sys.stderr.write(f"{prog}: warning: --no_auth: serving without a bearer token; anyone who can reach {reach} "
                         "can use the model\n")
    print(f"{name} server ready: {url} ({detail}, auth={'bearer' if bearer else 'off'})", flush=True)


def serve_until_stopped(start: Callable[[], S], announce: Callable[[S], None], name: str) -> None:
    """A server command's life: SIGTERM is handled before `start()` brings the server up, `announce(server)` prints
    its warning and ready line, then it serves until SIGTERM or Ctrl-C, stops the server (`server.stop()`) and
    prints "<name> server stopped"."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    server = start()
    announce(server)
    try:
        while not stop.wait(0.5):  # until SIGTERM or Ctrl-C
            pass
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    print(f"{name} server stopped", flush=True)
