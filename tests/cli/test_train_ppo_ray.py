"""train_ppo_ray from the command line: every misconfiguration fails before Ray starts (one line, exit code 2).
`ray job submit` with a working_dir runs on a four-node cluster in tests/distributed/test_multinode.py."""

from __future__ import annotations

import pytest

from rlhfkit.cli.common import run_cli
from rlhfkit.cli.train_ppo_ray import main
from tests.helpers import REPO, error_lines, run_module

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
