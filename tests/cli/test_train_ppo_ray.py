"""train_ppo_ray from the command line: every misconfiguration fails before Ray starts (one line, exit code 2),
and a tiny job runs to completion on a `ray start --head` cluster through `ray job submit`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlhfkit.cli.common import run_cli
from rlhfkit.cli.train_ppo_ray import main
from rlhfkit.distributed.launch import free_port
from tests.helpers import REPO, error_lines, run_module, start_ray_head, stop_ray_head

REWARD = str(REPO / "tests" / "distributed" / "reward_exact_match.py")
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "OMP_NUM_THREADS": "1"}


def argv(assets, out, *extra: str) -> list[str]:
    return ["--pretrain", str(assets.model_dir), "--prompt_data", str(assets.rl_train), "--input_key", "prompt",
            "--label_key", "answer", "--input_template", "User: {}\nAssistant: ", "--remote_rm_url", REWARD,
            "--max_samples", "4", "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
            "--micro_rollout_batch_size", "2", "--train_batch_size", "4", "--micro_train_batch_size", "1",
            "--generate_max_len", "8", "--prompt_max_len", "32", "--save_path", str(out), "--disable_progress_bar",
            "--actor_num_gpus_per_node", "1", "--critic_num_gpus_per_node", "1", "--ref_num_gpus_per_node", "1",
            "--reward_num_gpus_per_node", "1", *extra]


MISCONFIGURATIONS = {
    "hybrid engine devices": (["--colocate_all_models", "--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1",
                               "--advantage_estimator", "group_norm"],
                              ["--colocate_all_models needs actor devices", "= 2", "(= 1)"]),
    "group estimator with one sample": (["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "1",
                                         "--train_batch_size", "2"], ["--n_samples_per_prompt > 1"]),
    "rollout not divisible by train batch": (["--train_batch_size", "3"], ["--train_batch_size 3"]),
    "train batch not divisible by actor ranks": (["--actor_num_gpus_per_node", "3", "--train_batch_size", "4"],
                                                 ["actor devices 3"]),
    "critic ranks do not split the rollout": (["--advantage_estimator", "gae", "--critic_num_gpus_per_node", "3"],
                                              ["critic ranks", "--critic_num_nodes"]),
    "no reward source": (["--remote_rm_url", ""], ["no reward source"]),
    "colocated reference larger than actor": (["--colocate_actor_ref", "--ref_num_gpus_per_node", "2",
                                               "--advantage_estimator", "group_norm"],
                                              ["--colocate_actor_ref: ref needs 2 devices but the actor has 1"]),
    "tensor parallel vllm on cpu": (["--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "2",
                                     "--advantage_estimator", "group_norm"], ["--vllm_tensor_parallel_size 2"]),
    "missing model": (["--pretrain", "/nonexistent/model", "--advantage_estimator", "group_norm"],
                      ["--pretrain /nonexistent/model"]),
}


@pytest.mark.parametrize("case", sorted(MISCONFIGURATIONS))
def test_misconfiguration_fails_before_ray_with_one_line(case, demo_assets, tmp_path, capsys, monkeypatch):
    import rlhfkit.rl.ray_run as ray_run

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a misconfigured run")

    monkeypatch.setattr(ray_run, "connect_ray", no_ray)
    flags, needles = MISCONFIGURATIONS[case]
    if case == "no reward source":
        base = argv(demo_assets, tmp_path)
        i = base.index("--remote_rm_url")
        full = base[:i] + base[i + 2:]
    else:
        full = argv(demo_assets, tmp_path, *flags)
    code = run_cli(main, full, prog="train_ppo_ray")
    err = error_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    for needle in needles:
        assert needle in err[0], (needle, err[0])


def test_cli_process_exits_2_without_starting_ray(demo_assets, tmp_path):
    out = run_module(["rlhfkit.cli.train_ppo_ray", *argv(demo_assets, tmp_path, "--colocate_all_models",
                                                          "--actor_num_gpus_per_node", "2", "--vllm_num_engines",
                                                          "1", "--advantage_estimator", "group_norm")],
                     env={**RAY_ENV, "RAY_ADDRESS": ""}, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("rlhfkit.cli.train_ppo_ray: error:")
    assert "Ray instance" not in out.stdout + out.stderr  # ray.init would log "Started a local Ray instance"


def _wait_for_dashboard(port: int, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("the Ray dashboard did not come up")


def test_ray_job_submit_runs_group_norm_on_the_transformers_engine(demo_assets, tmp_path):
    """A job on a `ray start --head` cluster: group_norm on the Transformers engine, no colocation."""
    ray_bin = str(Path(sys.executable).with_name("ray"))
    env = {**os.environ, **RAY_ENV}
    env.pop("RAY_ADDRESS", None)
    dashboard = free_port()
    head, _, ray_tmp = start_ray_head(tmp_path / "ray_start.log", env, dashboard_port=dashboard)
    try:
        _wait_for_dashboard(dashboard, head, tmp_path / "ray_start.log")
        out = tmp_path / "run"
        # OpenRLHF's form: the checkout travels as the job's working_dir (Ray leaves out what .gitignore names)
        submit = [ray_bin, "job", "submit", "--address", f"http://127.0.0.1:{dashboard}",
                  "--runtime-env-json", json.dumps({"working_dir": str(REPO)}), "--", sys.executable,
                  "-m", "rlhfkit.cli.train_ppo_ray", *argv(demo_assets, out, "--advantage_estimator", "group_norm",
                                                           "--vllm_num_engines", "0", "--init_kl_coef", "0")]
        for _ in range(60):  # the dashboard answers before the node's job agent is up: "No available agent"
            job = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=400, cwd=REPO)
            if "No available agent" not in job.stdout + job.stderr:
                break
            time.sleep(1)
        assert job.returncode == 0 and "succeeded" in job.stdout, job.stdout[-3000:] + job.stderr[-2000:]
        assert "_ray_pkg_" in job.stdout + job.stderr, job.stdout[-3000:]  # the working_dir was uploaded
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "train/actor/policy_loss" in r]
        assert len(steps) == 2 and all(abs(r["train/actor/policy_loss"]) < 10 for r in steps)
        # step 2 sampled after the first sync: the engine's log-probs are the updated actor's
        assert steps[1]["train/rollout_logprob_diff"] < 1e-4
        assert (out / "model.safetensors").is_file()
    finally:
        stop_ray_head(head)
        shutil.rmtree(ray_tmp, ignore_errors=True)
