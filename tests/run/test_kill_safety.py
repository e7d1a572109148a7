"""SIGKILL at any moment: the newest complete checkpoint is what a rerun with --load_checkpoint resumes, and the
resumed chain of runs reaches the uninterrupted run's final weights.

Each trainer's chain is one run killed at each point of the issue in turn, every rerun resuming the last:
(c) while the checkpoint of step 2 is being written (the test hook `RLHFKIT_TEST_PAUSE`, see
`rlhfkit.run.pause_points`, pauses the writer after the files are in `.incomplete/` and before the rename, so
the kill lands there every time) -> the rerun must load global_step1; (b) mid-step 3 (after the first micro batch,
or after the rollout) -> the rerun loads global_step2; (a) between steps 3 and 4 -> the rerun loads global_step3
and finishes. The final weights must equal the uninterrupted run's (fp32, max abs diff <= 1e-6: the runs are
deterministic on the CPU, so any lost or repeated step, optimizer state or RNG draw shows as a difference far
larger than that), and the metrics file, read as the run report reads it, has each step once with the
uninterrupted run's losses.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from rlhfkit.logging.html_report import read_records
from tests.helpers import REPO, error_lines, run_here
from tests.run.signalled_runs import TEMPLATE, max_weight_diff, rl_args, start


def finish_here(args: list[str]) -> None:
    """The uninterrupted reference run of `args` in this process (`run_here`, a world of one): the same trainer and
    flags as the killed chain's subprocesses, without a subprocess's start-up (the runs are deterministic on the
    CPU)."""
    assert run_here(args, None).returncode == 0, args


def killed_at(args: list[str], point: str, flag: Path, timeout: float = 300) -> str:
    """Run until the hook pauses at `point`, SIGKILL it there; returns its output."""
    flag.unlink(missing_ok=True)
    proc = start(args, pause=f"{point}:{flag}", merge_stderr=True)
    deadline = time.monotonic() + timeout
    while not flag.is_file():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before reaching {point}:\n{proc.communicate()[0][-3000:]}")
        assert time.monotonic() < deadline, f"{point} not reached in time"
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children(recursive=True)  # e.g. the reward function's worker processes
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    _, alive = psutil.wait_procs(children, timeout=30)
    leaked = [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in alive if p.is_running()]
    for p in alive:
        p.kill()
    assert not leaked, f"processes of the killed run outlived it: {leaked}"
    return out


def losses(save: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_records(save / "metrics.jsonl") if key in r}


def kill_chain(args_for, reference: Path, tmp_path: Path, loss_key: str, capsys) -> None:
    save, ckpt, flag = tmp_path / "run", tmp_path / "ckpt", tmp_path / "paused"
    args = args_for(save, "--ckpt_path", str(ckpt), "--save_steps", "1")
    killed_at(args, "ckpt@2", flag)  # (c)
    assert (ckpt / ".incomplete" / "global_step2").is_dir() and not (ckpt / "global_step2").exists()
    assert (ckpt / "latest").read_text() == "global_step1"
    resume = [*args, "--load_checkpoint"]
    out = killed_at(resume, "mid@3", flag)  # (b)
    assert f"resumed from {ckpt / 'global_step1'} at step 1" in out, out[-3000:]
    assert not (ckpt / ".incomplete").exists()  # cleared at the start, no empty directory left by the save
    out = killed_at(resume, "between@3", flag)  # (a)
    assert f"resumed from {ckpt / 'global_step2'} at step 2" in out, out[-3000:]
    done = run_here(resume, capsys)  # the last rerun is not killed: in this process, without a start-up
    out = done.stdout + done.stderr
    assert done.returncode == 0 and f"resumed from {ckpt / 'global_step3'} at step 3" in out, out[-3000:]
    assert "Traceback" not in out
    assert max_weight_diff(reference, save) <= 1e-6
    expected = losses(reference, loss_key)
    assert len(expected) >= 4
    assert losses(save, loss_key) == pytest.approx(expected, rel=1e-6)
    raw = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in raw if loss_key in r] == sorted(expected)  # each step once, not only as read
    assert not list(tmp_path.glob(".*.saving"))  # the atomic final save left no staging directory


@pytest.fixture(scope="module")
def sft_reference(demo_assets, tmp_path_factory):
    save = tmp_path_factory.mktemp("sft_reference") / "run"
    finish_here(sft_args(demo_assets, save))
    assert (save / "model.safetensors").is_file()
    return save


def sft_args(assets, save: Path, *extra: str) -> list[str]:
    return ["rlhfkit.cli.train_sft", "--pretrain", str(assets.model_dir), "--dataset", str(assets.sft_train),
            "--max_samples", "32", "--max_epochs", "1", "--input_key", "question", "--output_key", "response",
            "--input_template", TEMPLATE, "--max_len", "40", "--train_batch_size", "8", "--micro_train_batch_size", "4",
            "--learning_rate", "1e-3", "--zero_stage", "0", "--save_path", str(save), "--disable_progress_bar",
            *extra]


def test_sft_sigkill_anywhere_resumes_to_the_same_weights(demo_assets, sft_reference, tmp_path, capsys):
    kill_chain(lambda save, *extra: sft_args(demo_assets, save, *extra), sft_reference, tmp_path, "train/loss",
               capsys)


def test_dpo_sigkill_anywhere_resumes_to_the_same_weights(demo_assets, tmp_path, capsys):
    def args_for(save: Path, *extra: str) -> list[str]:
        return ["rlhfkit.cli.train_dpo", "--pretrain", str(demo_assets.model_dir), "--dataset",
                str(demo_assets.pref_train), "--max_samples", "16", "--prompt_key", "prompt", "--input_template",
                TEMPLATE, "--max_len", "40", "--train_batch_size", "4", "--micro_train_batch_size", "2",
                "--learning_rate", "1e-3", "--beta", "0.1", "--zero_stage", "0", "--save_path", str(save),
                "--disable_progress_bar", *extra]

    reference = tmp_path / "reference"
    finish_here(args_for(reference))
    assert (reference / "model.safetensors").is_file()
    kill_chain(args_for, reference, tmp_path, "train/loss", capsys)


def test_ppo_sigkill_anywhere_resumes_to_the_same_weights(demo_assets, tmp_path, capsys):
    def args_for(save: Path, *extra: str) -> list[str]:
        return rl_args(demo_assets, tmp_path, save, *extra, rollout_batch_size=2, train_batch_size=4,
                       micro_train_batch_size=2, max_samples=8, generate_max_len=6)

    reference = tmp_path / "reference"
    finish_here(args_for(reference))
    assert (reference / "model.safetensors").is_file()
    kill_chain(args_for, reference, tmp_path, "train/reward", capsys)


def cli(capsys, module: str, argv: list[str]) -> tuple[int, str, str]:
    done = run_here([f"rlhfkit.cli.{module}", *argv], capsys)
    return done.returncode, done.stdout, done.stderr


def test_issue_checkpoint_defects_end_to_end(demo_assets, tmp_path, world_of_one, capsys):
    """The issue's defects, in order, on real SFT runs: a second run on a shared --ckpt_path pruned its own fresh
    checkpoints (exit 0); a missing `latest` meant "starting from scratch"; a truncated newest checkpoint gave a
    traceback; train_dpo "resumed" an SFT run's checkpoint."""
    ckpt = tmp_path / "ckpt"
    args = sft_args(demo_assets, tmp_path / "run", "--ckpt_path", str(ckpt), "--save_steps", "1",
                    "--max_ckpt_num", "2")[1:]
    code, _, err = cli(capsys, "train_sft", [*args, "--max_steps", "3"])
    assert code == 0, err
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step2", "global_step3"]

    code, _, err = cli(capsys, "train_sft", [*args, "--max_steps", "2"])
    assert code == 2 and "already holds checkpoints of a sft run (newest: global_step3)" in err, err
    code, out, err = cli(capsys, "train_sft", [*args, "--max_steps", "2", "--overwrite_ckpt"])
    assert code == 0 and "removed 2 checkpoint(s)" in out, err
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step1", "global_step2"]
    assert (ckpt / "latest").read_text() == "global_step2"

    (ckpt / "latest").unlink()
    code, out, err = cli(capsys, "train_sft", [*args, "--max_steps", "3", "--load_checkpoint"])
    assert code == 0, err
    assert "latest is missing; resuming from the newest complete checkpoint, global_step2" in out
    assert f"resumed from {ckpt / 'global_step2'} at step 2" in out
    assert sorted(p.name for p in ckpt.glob("global_step*")) == ["global_step2", "global_step3"]

    state = max((ckpt / "global_step3").rglob("*.pt"), key=lambda f: f.stat().st_size)
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    code, out, err = cli(capsys, "train_sft", [*args, "--max_steps", "4", "--load_checkpoint"])
    assert code == 0 and "Traceback" not in err, err
    assert "is truncated" in out and f"resumed from {ckpt / 'global_step2'} at step 2" in out

    code, _, err = cli(capsys, "train_dpo", ["--pretrain", str(demo_assets.model_dir), "--dataset",
                                              str(demo_assets.pref_train), "--max_samples", "16",
                                              "--train_batch_size", "8", "--micro_train_batch_size", "4",
                                              "--zero_stage", "0", "--save_path", str(tmp_path / "dpo"),
                                              "--ckpt_path", str(ckpt), "--load_checkpoint",
                                              "--disable_progress_bar"])
    assert code == 2 and "was written by sft, not dpo" in err and len(error_lines(err)) == 1, err
    assert not (tmp_path / "dpo" / "model.safetensors").exists()


def test_ppo_ray_driver_sigkill_leaks_no_actors_and_resumes_to_the_same_weights(demo_assets, tmp_path):
    """The driver (with its own local Ray, as `train_ppo_ray` starts one) is SIGKILLed mid-step 2: every process
    of its Ray cluster (GCS, raylet, the role and engine actors) goes with it, and a rerun with --load_checkpoint
    resumes global_step1 and ends at the uninterrupted run's weights (trained in this process, on the session's
    Ray cluster: no third local cluster to start)."""
    import psutil

    from rlhfkit.config.base import parse_config
    from rlhfkit.config.rl import PPOConfig
    from rlhfkit.rl.ray_run import run_ppo_ray
    from tests.distributed.ray_cluster import ensure_ray

    ray_env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_ADDRESS": ""}
    reward = str(REPO / "tests" / "distributed" / "reward_exact_match.py")

    def args_for(save: Path, *extra: str) -> list[str]:
        return ["rlhfkit.cli.train_ppo_ray", "--pretrain", str(demo_assets.model_dir), "--prompt_data",
                str(demo_assets.rl_train), "--input_key", "prompt", "--label_key", "answer", "--input_template",
                TEMPLATE, "--remote_rm_url", reward, "--advantage_estimator", "group_norm", "--max_samples", "4",
                "--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--micro_rollout_batch_size", "2",
                "--train_batch_size", "4", "--micro_train_batch_size", "2", "--generate_max_len", "6",
                "--prompt_max_len", "32", "--actor_learning_rate", "1e-3", "--zero_stage", "0", "--save_path",
                str(save), "--disable_progress_bar", *extra]

    reference = tmp_path / "reference"
    ensure_ray()  # the session's cluster (this test is in tests/selection.py's RAY group)
    run_ppo_ray(parse_config(PPOConfig, args_for(reference)[1:], "test"))
    assert (reference / "model.safetensors").is_file()
    saved_env = dict(os.environ)
    os.environ.update(ray_env)  # for the subprocesses `start` launches
    try:
        save, ckpt, flag = tmp_path / "run", tmp_path / "ckpt", tmp_path / "paused"
        args = args_for(save, "--ckpt_path", str(ckpt), "--save_steps", "1")
        proc = start(args, pause=f"mid@2:{flag}", merge_stderr=True)
        deadline = time.monotonic() + 300
        while not flag.is_file():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "mid@2 not reached in time"
            time.sleep(0.05)
        cluster = psutil.Process(proc.pid).children(recursive=True)
        names = {p.pid: " ".join(p.cmdline()) for p in cluster if p.is_running()}
        assert any("raylet" in name for name in names.values())
        proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        proc.communicate(timeout=60)
        agents = [p for p in cluster if "Agent" in names.get(p.pid, "")]
        _, alive = psutil.wait_procs([p for p in cluster if p not in agents], timeout=45)
        outlived = [names.get(p.pid) for p in alive if p.is_running()]
        for p in alive:
            p.kill()
        assert not outlived, outlived  # the actors, raylet and GCS share the driver's fate within 45 s
        # Ray's per-node agents watch their raylet on a slower poll (tens of seconds): the rerun starts meanwhile,
        # with a local cluster of its own as the session's cluster runs beside it, and the agents must still go
        rerun = start([*args, "--load_checkpoint"], merge_stderr=True)
        try:
            _, alive = psutil.wait_procs(agents, timeout=max(0.0, killed + 165 - time.monotonic()))
            leaked = [f"{p.pid} {names.get(p.pid, '')[:100]}" for p in alive if p.is_running()]
            for p in alive:  # do not leave them for the next test either way
                p.kill()
            assert not leaked, leaked
            out, _ = rerun.communicate(timeout=600)
        finally:
            if rerun.poll() is None:
                rerun.kill()
                rerun.communicate()
        assert f"resumed from {ckpt / 'global_step1'} at step 1" in out and "Traceback" not in out, out[-3000:]
        assert max_weight_diff(reference, save) <= 1e-6
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
