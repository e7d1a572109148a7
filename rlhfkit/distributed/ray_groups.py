"""A role as a group of Ray actors that looks exactly like the local role object.

`RayActorGroup(factory, slots, plan)` starts one Ray actor per rank, pinned to its placement-group bundle. The
ranks form their own torch.distributed world (gloo on CPU, NCCL on GPUs): rank 0 picks its node address and a
free port, every rank sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and joins the group before
`factory()` builds the local role object (a role from `rlhfkit.rl.roles`, whose DeepSpeed strategy then
finds the group already made). Calling a method on the group calls it on the ranks:

- "split": the first positional argument (a list, a tensor, or a dict/tuple of them) is cut into world-size
  contiguous slices, rank r gets slice r, and the results are joined back in order (lists and tensors
  concatenated, dicts joined key by key, numbers averaged over ranks);
- "broadcast" (the default): every rank gets the same arguments (collectives such as a ZeRO-3 gather or an
  optimizer step need all ranks) and rank 0's result is returned.

A role declares a method's mode next to the method with `@dispatch("split")` (`rlhfkit.rl.roles`); an
undecorated method broadcasts. So the RL loop cannot tell a group from the local object. With
`offload_between_calls` (`--deepspeed_enable_sleep`) every rank reloads its DeepSpeed states before a call and
offloads them after it, so a role holds accelerator memory only while one of its methods runs (see
`rlhfkit/distributed/weight_sync.py: offload_states`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from rlhfkit.distributed.determinism import determinism_env, flag_from_env
from rlhfkit.distributed.placement import ResourcePlan, Slot
from rlhfkit.distributed.rank_split import join_from_ranks as join_from_ranks
from rlhfkit.distributed.rank_split import results_of_groups, split_for_groups
from rlhfkit.distributed.rank_split import split_for_ranks as split_for_ranks
from rlhfkit.distributed.startup_clock import mark
from rlhfkit.errors import ComponentFailed
from rlhfkit.models.cpu_gemm import ENV as CPU_GEMM_ENV
from rlhfkit.models.cpu_gemm import kernel_for_workers

#: Environment of every role process. Threads: one unless the actor's slot says how many CPUs its bundle has
#: (`worker_env(slot=...)`); oversubscription is the main CPU trap.
WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PYTHONUNBUFFERED": "1",
}
_PASS_THROUGH = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "WANDB_MODE", "DS_ACCELERATOR",
                 "TORCH_EXTENSIONS_DIR", "RAY_AUTH_MODE", "VLLM_CPU_KVCACHE_SPACE", "VLLM_LOGGING_LEVEL")


def _node_of(_instance: Any) -> tuple[str, str]:
    import ray

    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


#: Where each actor of this run lives (actor id hex -> (node id, IP)), filled by `actor_nodes`: the error of an actor
#: that died names its node (a lost machine), which Ray's own message does not always do.
_NODES: dict[str, tuple[str, str]] = {}


def actor_nodes(actors: Sequence[Any], what: str) -> list[tuple[str, str]]:
    """(Ray node id, node IP) of each actor, in order; works for any actor class (`__ray_call__`)."""
    where = list(ray_get([a.__ray_call__.remote(_node_of) for a in actors], what))
    for actor, node in zip(actors, where):
        _NODES[actor._actor_id.hex()] = tuple(node)
    return where


def _actor_death(e: BaseException) -> str:
    """`ActorDiedError: <why>` with the actor's node when this run recorded it."""
    node = _NODES.get(str(getattr(e, "actor_id", "") or ""))
    where = f"on node {node[1]}/{node[0][:8]}: " if node else ""
    return f"{type(e).__name__}: {where}{death_cause(str(e))}"


def kill_actors(actors: Sequence[Any]) -> None:
    """Kill Ray actors, best effort (shutdown goes on past one that is already gone)."""
    import ray

    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - best effort on shutdown
            pass


def worker_env(extra: dict[str, str] | None = None, slot: Slot | None = None) -> dict[str, str]:
    """Env vars for a role's Ray actors: WORKER_ENV, as many threads as the slot's bundle has CPUs (one under
    --full_determinism, with its other settings), offline switches of this process, the CPU linear kernel this
    driver chose for the whole run (`cpu_gemm.kernel_for_workers`), and `extra`."""
    env = dict(WORKER_ENV)
    env[CPU_GEMM_ENV] = kernel_for_workers()
    if slot is not None:
        env.update(OMP_NUM_THREADS=str(slot.threads), MKL_NUM_THREADS=str(slot.threads))
    if flag_from_env():
        env.update(determinism_env())
    env.update({k: os.environ[k] for k in _PASS_THROUGH if k in os.environ})
    env.update(extra or {})
    return env


# -- splitting and joining batches over ranks -------------------------------------------------------------------
DISPATCH_MODES = ("split", "broadcast")
_F = TypeVar("_F", bound=Callable[..., Any])


def dispatch(mode: str) -> Callable[[_F], _F]:
    """Declare how a role method is called over a group's ranks ("split" or "broadcast", see the module
    docstring); `RayActorGroup` reads it from the role class. Put it outermost, above `@torch.no_grad()`."""
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch mode {mode!r}: use one of {', '.join(DISPATCH_MODES)}")

    def mark(method: _F) -> _F:
        method.dispatch_mode = mode  # type: ignore[attr-defined]
        return method

    return mark


class RoleWorker:
    """The body of one rank's Ray actor: joins the group's process group, builds and serves the local role."""

    def __init__(self, rank: int, world_size: int, env: dict[str, str]):
        mark("started")  # the process is up (or reused) and this module imported
        os.environ.update(env)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        self.rank, self.world_size = rank, world_size
        self.role: Any = None
        self.offload_between_calls = False

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (asked of rank 0: the group's rendezvous)."""
        import ray

        from rlhfkit.distributed.launch import free_port

        return ray.util.get_node_ip_address(), free_port()

    def setup(self, master_addr: str, master_port: int, factory: Callable[[], Any],
              offload_between_calls: bool = False) -> int:
        # LOCAL_RANK 0: Ray narrows CUDA_VISIBLE_DEVICES to the one GPU of this actor's bundle.
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        from rlhfkit.distributed.launch import init_distributed

        init_distributed()
        mark("process_group")
        self.role = factory()
        mark("role_built")
        self.offload_between_calls = offload_between_calls
        if offload_between_calls:
            self._offload()
        return os.getpid()

    def _offload(self) -> None:
        from rlhfkit.distributed.weight_sync import offload_states

        offload_states(self.role)

    def _reload(self) -> None:
        from rlhfkit.distributed.weight_sync import reload_states

        reload_states(self.role)

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        if self.offload_between_calls:
            self._reload()
        try:
            return getattr(self.role, method)(*args, **kwargs)
        finally:
            if self.offload_between_calls:
                self._offload()

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run `fn(role, *args, **kwargs)` on this rank (helpers such as weight sync that roles do not own)."""
        if self.offload_between_calls:
            self._reload()
        try:
            return fn(self.role, *args, **kwargs)
        finally:
            if self.offload_between_calls:
                self._offload()

    def ping(self) -> int:
        return os.getpid()


#: Seconds one Ray call (a role's step, a generation, a weight sync) may take before the run stops; set once per
#: run from --ray_call_timeout (`set_call_timeout`). A dead actor is reported at once, whatever this is.
_CALL_TIMEOUT_S: list[float | None] = [None]


def set_call_timeout(seconds: float | None) -> None:
    _CALL_TIMEOUT_S[0] = seconds


def death_cause(text: str) -> str:
    """One line of why a Ray actor died, from Ray's message: the node's death with the node's IP when that is the
    cause (a lost machine), else the message's first line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "no reason given"
    ip = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("ip:")), "")
    node = next((line for line in lines if "node" in line.lower() and any(
        word in line.lower() for word in ("died", "dead", "terminated", "preempted", "lost"))), None)
    if node is not None:
        return (f"node {ip}: " if ip else "") + node[:300]
    return lines[0][:300]


_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _dead_peer(refs: Any, text: str) -> str | None:
    """When a rank's call failed because a peer's connection dropped (gloo: "Connection reset by peer"), the cause
    to report is that peer's death (its actor's RayActorError), if one of `refs` shows it within a few seconds."""
    import ray
    from ray.exceptions import RayActorError

    if not any(gone in text for gone in _PEER_GONE):
        return None
    for ref in refs if isinstance(refs, list) else [refs]:
        try:
            ray.get(ref, timeout=20)
        except RayActorError as e:
            return _actor_death(e)
        except Exception:  # noqa: BLE001 - this rank's own failure, or no answer yet: look at the next
            continue
    return None


def ray_get(refs: Any, what: str, timeout: float | None = None) -> Any:
    """`ray.get` that turns a dead actor, a call past the timeout or a collective past --ddp_timeout inside the call
    into ComponentFailed naming `what` and the cause (any other exception raised inside the call, e.g. a UserError,
    still propagates as itself)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    from rlhfkit.distributed.launch import collective_timeout_message

    limit = _CALL_TIMEOUT_S[0] if timeout is None else timeout
    try:
        return ray.get(refs, timeout=limit)
    except GetTimeoutError:
        raise ComponentFailed(f"{what}: no answer within --ray_call_timeout {limit:g} s; the run stopped (rerun "
                              "with --load_checkpoint to continue from the last checkpoint)") from None
    except RayActorError as e:
        raise ComponentFailed(f"{what}: its Ray actor died ({_actor_death(e)}); the run stopped (rerun with "
                              "--load_checkpoint to continue from the last checkpoint)") from None
    except RayTaskError as e:  # a rank's collective past --ddp_timeout (its peer died or hangs) names the flag
        message = collective_timeout_message(getattr(e, "cause", None) or e)
        if message is not None:
            raise ComponentFailed(f"{what}: {message}") from None
        dead = _dead_peer(refs, str(e))  # a rank whose peer's connection dropped: the peer's death is the cause
        if dead is None:
            raise
        raise ComponentFailed(f"{what}: its Ray actor died ({dead}); the run stopped (rerun with --load_checkpoint "
                              "to continue from the last checkpoint)") from None


class RayActorGroup:
    """The ranks of one role as Ray actors, with the local role's methods (see the module docstring).

    `role_cls` is the local role class: rank r builds `role_cls(*init_args, **init_kwargs)` (or `factory()` when
    given), and only its public methods are served. A method's dispatch mode is the one its `@dispatch(...)`
    declares, else "broadcast". With `sp_size` (--ring_attn_size) > 1 the ranks of each sequence-parallel group
    get the same part of a "split" call (`rlhfkit.distributed.rank_split.split_for_groups`).
    """

    def __init__(self, name: str, role_cls: type | None, plan: ResourcePlan, slots: list[Slot], *,
                 init_args: tuple = (), init_kwargs: dict[str, Any] | None = None,
                 factory: Callable[[], Any] | None = None, env: dict[str, str] | None = None,
                 offload_between_calls: bool = False, wait: bool = True, sp_size: int = 1):
        import ray

        if factory is None:
            if role_cls is None:
                raise ValueError("give role_cls or factory")
            factory = functools.partial(role_cls, *init_args, **(init_kwargs or {}))
        self.name = name
        self.role_cls = role_cls
        self.world_size = len(slots)
        self.sp_size = sp_size  # --ring_attn_size: ranks that share the rows of a "split" call
        self.workers: list[Any] = []
        remote_cls = ray.remote(RoleWorker)
        for rank, slot in enumerate(slots):
            # The env travels as an argument, not a runtime_env: Ray then reuses its prestarted worker processes
            # (measured: 0.2-0.7 s per actor instead of 1.8-2.5 s), and the constructor sets it before any model
            # library is imported in that process.
            worker = remote_cls.options(
                num_cpus=slot.num_cpus, num_gpus=slot.num_gpus, scheduling_strategy=plan.scheduling(slot),
            ).remote(rank, self.world_size, worker_env(env, slot))
            self.workers.append(worker)
        master_addr, master_port = self.rank0_address()
        self._setup = [w.setup.remote(master_addr, master_port, factory, offload_between_calls)
                       for w in self.workers]
        self.pids: list[int] = []
        if wait:
            self.ready()

    def ready(self) -> RayActorGroup:
        """Wait until every rank has joined the group and built its role (start groups together, then wait)."""

        if not self.pids:
            self.pids = ray_get(self._setup, f"the {self.name} role (starting)")
        return self

    def rank0_address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port there (for rendezvous of groups that include rank 0)."""

        return ray_get(self.workers[0].address.remote(), f"the {self.name} role")

    def mode(self, method: str) -> str:
        return getattr(getattr(self.role_cls, method, None), "dispatch_mode", "broadcast")

    # -- calls ----------------------------------------------------------------------------------------------
    def call_async(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Start `method` on every rank (dispatched as configured); returns one Ray ObjectRef per rank."""
        if self.mode(method) == "split" and args:
            parts = split_for_groups(args[0], self.world_size, self.sp_size)
            return [w.call.remote(method, (part, *args[1:]), kwargs) for w, part in zip(self.workers, parts)]
        return [w.call.remote(method, args, kwargs) for w in self.workers]

    def collect(self, method: str, refs: list[Any]) -> Any:
        """Wait for `call_async` results and join them as the method's dispatch mode says."""

        results = ray_get(refs, f"the {self.name} role ({method})")
        if self.mode(method) == "split":
            return join_from_ranks(results_of_groups(results, self.sp_size))
        return results[0]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.collect(method, self.call_async(method, *args, **kwargs))

    def run_async(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Start `fn(role, *args, **kwargs)` on every rank; one ObjectRef per rank."""
        return [w.run.remote(fn, args, kwargs) for w in self.workers]

    def run_on_ranks(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """`fn(role, *args, **kwargs)` on every rank; returns every rank's result."""

        return ray_get(self.run_async(fn, *args, **kwargs), f"the {self.name} role")

    def __getattr__(self, method: str) -> Callable[..., Any]:
        # Only reached for names that are not attributes of the group: serve the role's public methods.
        if method.startswith("_") or "role_cls" not in self.__dict__:
            raise AttributeError(method)
        if self.role_cls is not None and not callable(getattr(self.role_cls, method, None)):
            raise AttributeError(f"{self.role_cls.__name__} has no method {method!r}")

        def remote_method(*args: Any, **kwargs: Any) -> Any:
            return self.call(method, *args, **kwargs)

        remote_method.__name__ = method
        return remote_method

    def kill(self) -> None:
        kill_actors(self.workers)
        self.workers = []
