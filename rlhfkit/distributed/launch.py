"""Process-group bootstrap that works under `deepspeed --module`, `torchrun -m` and plain `python -m`."""

from __future__ import annotations

import datetime
import os
import random
import re
import socket
import sys
from typing import Any

import torch

#: Default of --ddp_timeout: how long a collective (or the rendezvous) waits for its peers. Generous, as a ZeRO-3
#: gather of a large model or a slow checkpoint write on one rank can keep the others waiting for minutes.
DEFAULT_DIST_TIMEOUT_S = 1800.0
#: How a process that joins a group without the config in hand (a Ray role worker) gets --ddp_timeout.
DIST_TIMEOUT_ENV = "RLHFKIT_DDP_TIMEOUT"
#: The timeout of this process's default group, once initialised (for the error message of a timed-out collective).
_ACTIVE_TIMEOUT_S: list[float | None] = [None]


def default_ds_accelerator() -> None:
    """Without CUDA, tell DeepSpeed it runs on CPU (it otherwise warns on import that it fell back to CPU)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


# Rendezvous ports are drawn below the kernel's ephemeral range (Linux: 32768-60999) and above Ray's worker ports
# (10002-19999): a port the kernel hands out at random (port 0) is soon handed to another process's outgoing
# connection, which then holds it when the rendezvous binds (EADDRINUSE).
_PORTS = (20000, 32000)
_RANDOM = random.SystemRandom()  # not the seeded module-level generator: seeded runs side by side draw alike


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, from `_PORTS` (else any free port)."""
    for _ in range(64):
        port = _RANDOM.randrange(*_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def world_size_from_env() -> int:
    """World size as the launcher set it (1 for plain python)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank_from_env() -> int:
    return int(os.environ.get("RANK", "0"))


def ensure_single_process_env() -> None:
    """Plain `python -m` has no launcher: describe a world of one on loopback."""
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def default_backend() -> str:
    """NCCL with GPUs, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def dist_timeout_s(explicit: float | None = None) -> float:
    """The collective timeout: `explicit` (the config's --ddp_timeout), else $RLHFKIT_DDP_TIMEOUT, else 30 min."""
    if explicit is not None:
        return float(explicit)
    return float(os.environ.get(DIST_TIMEOUT_ENV) or DEFAULT_DIST_TIMEOUT_S)


def init_distributed(timeout_s: float | None = None) -> None:
    """Join torch.distributed's default group (idempotent), gloo or NCCL, with `dist_timeout_s(timeout_s)` as the
    timeout of the rendezvous and of every collective of that group.

    DeepSpeed is not imported here: a process that never builds a DeepSpeed engine (the plain-torch engine at world
    size 1, FSDP2, the frozen roles below ZeRO-3) never pays its import (0.4-0.8 s quiet, up to 8 s under load,
    about 25 MB). `import_deepspeed` joins DeepSpeed's communication layer to this group where an engine is built."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == 1:  # a world of one joined earlier in this process (a notebook, a test run)
            for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                os.environ.setdefault(key, value)  # DeepSpeed's engine reads LOCAL_RANK from the environment
        return
    seconds = dist_timeout_s(timeout_s)
    ensure_single_process_env()
    backend = default_backend()
    kwargs: dict = {"timeout": datetime.timedelta(seconds=seconds)}
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        if world_size_from_env() != 1:  # bind the device as DeepSpeed's own init does (a world of one has no peer)
            kwargs["device_id"] = torch.device("cuda", local_rank)
    _forget_deepspeed_world_group()
    dist.init_process_group(backend, init_method="env://", **kwargs)
    _ACTIVE_TIMEOUT_S[0] = seconds


def import_deepspeed() -> Any:
    """The `deepspeed` module, its communication layer joined to this process's default group (call
    `init_distributed` first): what every place that builds a DeepSpeed engine imports DeepSpeed through. On gloo the
    shared-memory comm op stays off: DeepSpeed JIT-compiles it for minutes on first use, and gloo needs none of it."""
    default_ds_accelerator()
    import deepspeed
    import torch.distributed as dist

    backend = default_backend()
    if backend == "gloo":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if dist.is_initialized() and not deepspeed.comm.is_initialized():  # wraps the running group, joins nothing
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(seconds=dist_timeout_s(_ACTIVE_TIMEOUT_S[0])))
    return deepspeed


def _forget_deepspeed_world_group() -> None:
    """A process that joins a new default group after destroying an earlier one (two runs in one notebook, a test
    session): DeepSpeed keeps a clone of the first world group (`deepspeed.utils.groups._WORLD_GROUP`), and its next
    engine would use it ("Group ... is not registered"). Drop the stale clone; DeepSpeed makes a new one. A process
    that never imported DeepSpeed has no clone (and does not import it for this)."""
    if "deepspeed" not in sys.modules:
        return
    from deepspeed.utils import groups

    if getattr(groups, "_WORLD_GROUP", None) is not None:
        groups._WORLD_GROUP = None


#: gloo: "Timed out waiting 3000ms for recv operation"; NCCL's watchdog: "collective operation timeout"; the
#: rendezvous store: "has timed out after 3000ms" / "Socket Timeout" / "wait timeout".
_TIMED_OUT = re.compile(r"Timed out waiting \d+ms|collective operation timeout|has timed out after|"
                        r"Socket Timeout|[Ww]ait timeout")


def leave_process_group() -> None:
    """Tear the default process group down now, after a collective timed out: left to interpreter exit, gloo's
    worker threads are destroyed unjoined and the process aborts (SIGABRT, "terminate called without an active
    exception") instead of exiting with the run's code."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group is broken already; exiting is all that is left
            pass


def collective_timeout_message(e: BaseException) -> str | None:
    """One line for an exception that is a collective (or rendezvous) past --ddp_timeout, naming the flag; None
    for any other exception. gloo raises RuntimeError("... Timed out waiting 3000ms for recv ..."), NCCL a
    DistBackendError (a RuntimeError) from its watchdog."""
    if not isinstance(e, RuntimeError) or not _TIMED_OUT.search(str(e)):
        return None
    first = (str(e).strip().splitlines() or [""])[0]
    first = re.sub(r"^\[[^\]]*\] ", "", first)[:300]  # gloo prefixes the C++ source location
    limit = _ACTIVE_TIMEOUT_S[0]
    after = f"--ddp_timeout {limit:g} s" if limit is not None else "--ddp_timeout"
    return (f"a torch.distributed collective waited past {after} for a peer rank that died or is stuck "
            f"({first}); the run stopped (raise --ddp_timeout if a rank is just slow; rerun with --load_checkpoint "
            "to continue from the last checkpoint)")
