"""The process-group bootstrap: --ddp_timeout reaches init_process_group, so a rank whose peer never arrives at a
collective stops with a message naming the flag instead of hanging (2 real processes over gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlhfkit.distributed.launch import (
    DEFAULT_DIST_TIMEOUT_S,
    DIST_TIMEOUT_ENV,
    collective_timeout_message,
    dist_timeout_s,
    free_port,
)
from rlhfkit.errors import UserError
from tests.helpers import REPO


def test_timeout_comes_from_the_flag_then_the_env_then_30_minutes(monkeypatch):
    monkeypatch.delenv(DIST_TIMEOUT_ENV, raising=False)
    assert dist_timeout_s() == DEFAULT_DIST_TIMEOUT_S == 1800
    monkeypatch.setenv(DIST_TIMEOUT_ENV, "42")
    assert dist_timeout_s() == 42 and dist_timeout_s(7) == 7


def test_only_timeouts_are_explained():
    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                        "3000ms for recv operation to complete")
    assert collective_timeout_message(gloo).startswith("a torch.distributed collective waited past --ddp_timeout")
    assert "(Timed out waiting 3000ms for recv operation to complete)" in collective_timeout_message(gloo)
    assert collective_timeout_message(RuntimeError("shape mismatch")) is None
    assert collective_timeout_message(ValueError("Timed out waiting 3000ms")) is None


@pytest.mark.parametrize("value, shown", [("0", "0.0"), ("-5", "-5.0"), ("nan", "nan")])
def test_ddp_timeout_must_be_positive(value, shown):
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.sft import SFTConfig

    with pytest.raises(UserError, match=f"--ddp_timeout {shown}: must be a positive number of seconds"):
        parse_config(SFTConfig, ["--pretrain", "x", "--dataset", "y", "--ddp_timeout", value], "test")


@pytest.mark.limit(180)
def test_rank_whose_peer_never_arrives_fails_after_the_timeout(tmp_path):
    timeout = 3
    port, joined = free_port(), tmp_path / "rank1_joined"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop(DIST_TIMEOUT_ENV, None)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.distributed.absent_peer", str(timeout), str(joined)],
                              env={**env, "RANK": str(rank)}, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 150
        while not joined.exists():  # both ranks are in the group; from here rank 0 waits for rank 1
            assert procs[0].poll() is None, procs[0].communicate()
            assert time.monotonic() < deadline, "rank 1 did not join the group in time"
            time.sleep(0.05)
        waited_from = time.monotonic()
        _, err = procs[0].communicate(timeout=120)
        waited = time.monotonic() - waited_from
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)
    lines = err.strip().splitlines()
    print(f"rank 0 stopped {waited:.1f} s after rank 1 joined: {lines[-1] if lines else ''}")
    assert procs[0].returncode == 1, err[-3000:]
    assert lines[-1].startswith(f"absent_peer: error: rank 0: a torch.distributed collective waited past "
                                f"--ddp_timeout {timeout} s for a peer rank that died or is stuck"), err[-3000:]
    assert "Timed out waiting 3000ms" in lines[-1] and "Traceback" not in err
    assert timeout - 0.5 <= waited < timeout + 20, waited  # the timeout, not the 30-minute default, not a hang


def test_a_world_of_one_joined_earlier_is_described_again():
    """A second in-process run (a notebook, the next test module) finds the group of the first one joined but its
    launcher variables gone: init_distributed puts RANK / LOCAL_RANK / WORLD_SIZE back, since DeepSpeed's engine
    refuses to start without LOCAL_RANK. init_distributed joins without DeepSpeed (a plain-torch role never pays its
    import); import_deepspeed then wraps the running group in DeepSpeed's comm layer without building the shm comm
    op (a minutes-long JIT compile on gloo). One subprocess for both: it costs a torch import."""
    script = (
        "import os, sys\n"
        "from rlhfkit.distributed.launch import import_deepspeed, init_distributed\n"
        "init_distributed()\n"
        "for key in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'):\n"
        "    os.environ.pop(key)\n"
        "init_distributed()\n"
        "print([os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE')], 'deepspeed' in sys.modules)\n"
        "deepspeed = import_deepspeed()\n"
        "print(deepspeed.comm.is_initialized(), deepspeed.comm.get_world_size(),\n"
        "      deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'], deepspeed.comm.comm.cdb.shm_comm_op)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-2:] == ["['0', '0', '1'] False", "True 1 False None"], out.stdout
