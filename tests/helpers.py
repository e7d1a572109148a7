"""Helpers shared by tests (import as `from tests.helpers import ...`)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

REPO = Path(__file__).resolve().parents[1]
# A `ray start --block` node that gets SIGTERM first drains for up to 30 s (Ray 2.60, for Kubernetes pods): a test's
# node stops at once. Measured: a lone head 30.1 s -> 3.6 s to stop; the head of a 2-node cluster 15.2 s (the
# stop's 15 s bound, then SIGKILL) -> 5.0 s.
NO_DRAIN = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
# the start-up lines of rlhfkit.config.openrlhf_defaults.startup_notes ("rlhfkit: --x not given: ... OpenRLHF ...")
STARTUP_NOTE = re.compile(r"^rlhfkit: --\S+( \(--\S+\))? not given: .* OpenRLHF uses .*"
                          r"\(docs/migration\.md#defaults\)$")


def without_startup_notes(err: str) -> str:
    """stderr without the lines that name the defaults a command takes where OpenRLHF's differ: what is left is
    the command's own output (an error is one line of it)."""
    return "".join(line for line in err.splitlines(keepends=True) if not STARTUP_NOTE.match(line.rstrip("\n")))


def error_lines(err: str) -> list[str]:
    """The lines of stderr, the start-up notes left out (`without_startup_notes`)."""
    return without_startup_notes(err).strip().splitlines()


def run_module(args: list[str], *, launcher: list[str] | None = None, timeout: float = 300,
               env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m ...` (or a launcher such as torchrun) as a real subprocess with test-safe settings."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = (launcher or [sys.executable, "-m"]) + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)


def run_here(args: list[str], capsys: pytest.CaptureFixture[str] | None) -> subprocess.CompletedProcess:
    """`run_module(args)` in this process, for a test whose subject is the run rather than its process: the module's
    own `main` through `run_cli`, `sys.argv` as `python -m` sets it; the exit code and the output come back as a
    CompletedProcess. A run in a process of its own first spends 5-6 CPU seconds importing torch, Transformers and
    DeepSpeed, which this process holds already. Each run is a world of one, and the environment, the thread count
    and the determinism switches are restored afterwards. A test of what only a process shows (a signal, a
    launcher, exit at interpreter level, variables read at import) keeps `run_module`. Without `capsys` (a fixture
    wider than a test cannot take it) the output goes to pytest's own capture and comes back empty."""
    import importlib

    from rlhfkit.cli.common import run_cli

    module = importlib.import_module(args[0])
    if capsys is not None:
        capsys.readouterr()
    saved_argv = sys.argv
    sys.argv = [str(module.__file__), *args[1:]]  # as `python -m` sets it (a run records its command line)
    try:
        with launcher_env_of_one(), torch_determinism_restored():
            code = run_cli(module.main, args[1:], prog=getattr(module, "PROG", args[0]))
    except SystemExit as e:  # argparse's errors and --help: the exit code a process would have
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = saved_argv
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return subprocess.CompletedProcess(args, code, out, err)


@contextmanager
def launcher_env_of_one() -> Iterator[None]:
    """The launcher variables of a world of one (RANK 0, WORLD_SIZE 1, a free MASTER_PORT) for code that joins a
    process group in this process (a DeepSpeed engine, an in-process trainer); the whole environment is restored
    afterwards, so later subprocesses never inherit RANK/WORLD_SIZE/MASTER_*."""
    from rlhfkit.distributed.launch import free_port

    saved = dict(os.environ)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def start_ray_head(log_path: Path, env: dict[str, str], dashboard_port: int | None = None, num_cpus: int = 4
                   ) -> tuple[subprocess.Popen, int, str]:
    """`ray start --head --block` on 127.0.0.1 in its own process session, every port chosen free (a second Ray
    instance on this machine, this session's own or a colleague's, holds the default agent ports, and this head's
    agents would never come up); the dashboard only when `dashboard_port` is given. Returns (process, GCS port,
    temp dir); stop it with `stop_ray_head`. Its output goes to `log_path`."""
    from rlhfkit.distributed.launch import free_port

    ray_bin = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    ports = [arg for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                              "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port",
                              "--ray-client-server-port") for arg in (flag, str(free_port()))]
    dashboard = (["--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port), "--include-dashboard",
                  "true"] if dashboard_port else ["--include-dashboard", "false"])
    ray_tmp = tempfile.mkdtemp(prefix="rk", dir="/tmp")  # short: Ray's unix socket paths must stay < 108 chars
    env = {**{k: v for k, v in env.items() if k != "RAY_ADDRESS"}, **NO_DRAIN}
    with open(log_path, "w") as log:
        head = subprocess.Popen(
            [ray_bin, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
             *dashboard, "--num-cpus", str(num_cpus), "--num-gpus", "0", "--temp-dir", ray_tmp,
             "--disable-usage-stats", *ports], env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT,
            cwd=REPO)
    return head, port, ray_tmp


def start_ray_worker(gcs_port: int, log_path: Path, env: dict[str, str], num_cpus: int = 1) -> subprocess.Popen:
    """`ray start --address 127.0.0.1:PORT --block`: one more Ray node on this machine (its own raylet, object store
    and agents, every port free), in its own process session: `stop_ray_head` stops it, and killing its process
    group takes the node down as a machine failure would."""
    from rlhfkit.distributed.launch import free_port

    ray_bin = str(Path(sys.executable).with_name("ray"))
    ports = [arg for flag in ("--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
                              "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port")
             for arg in (flag, str(free_port()))]
    env = {**{k: v for k, v in env.items() if k != "RAY_ADDRESS"}, **NO_DRAIN}
    # A temp dir of its own: without one a node uses /tmp/ray, where every other Ray instance on the machine keeps
    # (and garbage-collects) its runtime environments, working_dir packages included.
    ray_tmp = tempfile.mkdtemp(prefix="rkw", dir="/tmp")
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [ray_bin, "start", "--address", f"127.0.0.1:{gcs_port}", "--block", "--node-ip-address", "127.0.0.1",
             "--num-cpus", str(num_cpus), "--num-gpus", "0", "--temp-dir", ray_tmp, "--disable-usage-stats", *ports],
            env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def stop_ray_head(head: subprocess.Popen, timeout: float = 15) -> None:
    """Stop only the cluster a test started: its process group (a plain `ray stop` would also stop every other Ray
    instance on a shared machine)."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=timeout)
    except ProcessLookupError:
        pass


@contextmanager
def torch_determinism_restored() -> Iterator[None]:
    """Undo what `--full_determinism` switches in this process (deterministic algorithms, cuDNN and oneDNN modes,
    the intra-op thread count, its environment variables) once an in-process run with the flag is done."""
    import torch

    from rlhfkit.distributed.determinism import FLAG_ENV

    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.backends.mkldnn.deterministic, torch.get_num_threads(),
             {k: os.environ.get(k) for k in (FLAG_ENV, "CUBLAS_WORKSPACE_CONFIG")})
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1], saved[2]
        torch.backends.mkldnn.deterministic = saved[3]
        torch.set_num_threads(saved[4])
        for key, value in saved[5].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def spawn_ranks(rank_main: Callable[[int, int, int], None], world: int) -> None:
    """Run `rank_main(rank, world, port)` in `world` spawned processes (one thread each unless OMP_NUM_THREADS
    says otherwise), `port` a free one for their gloo rendezvous; a rank that raises fails the caller."""
    import torch.multiprocessing as mp

    from rlhfkit.distributed.launch import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_rank_then_exit, args=(rank_main, world, free_port()), nprocs=world, start_method="spawn")


def _rank_then_exit(rank: int, rank_main: Callable[[int, int, int], None], world: int, port: int) -> None:
    """One spawned rank: `rank_main`, then, when it returned, leave the process group and exit without the
    interpreter's C++ teardown, where a finished gloo rank can abort (SIGABRT, "terminate called without an active
    exception": a 2-rank ZeRO-3 EMA test's rank did in a fresh-clone CI run of 2026-11-28, after its checks passed).
    The runs themselves exit the same way (`rlhfkit/cli/common.py`). A rank that raises is reported as before."""
    from rlhfkit.distributed.launch import leave_process_group

    rank_main(rank, world, port)
    leave_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
