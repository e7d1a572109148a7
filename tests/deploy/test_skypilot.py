"""The SkyPilot task files load with SkyPilot's own parser, and every rlhfkit command in them parses with its flags.

SkyPilot is a test-only dependency with a large dependency tree of its own, so `make install` puts it in a separate
directory (.venv/skypilot-pkgs) and the parser runs in a subprocess with only that directory added; the main venv
never sees it. No cloud access and no API server: `sky.Task.from_yaml` validates the schema offline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from rlhfkit.cli import catalog
from tests.deploy.shell_stubs import rlhfkit_calls, run_with_stubs

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "deploy" / "skypilot"
YAMLS = sorted(TASKS.glob("*.yaml"))

_LOADER = r"""
import json, sys
import sky
from sky.client.cli import command
from sky.utils import yaml_utils

out = {}
for path in sys.argv[1:]:
    task = sky.Task.from_yaml(path)  # the parser `sky launch` uses
    config = yaml_utils.read_yaml(path)
    declared = sorted((config.get("secrets") or {}).keys())
    # what `sky launch --secret NAME` does with each declared secret
    with_secrets = sky.Task.from_yaml_config(config, secrets_overrides=[(k, "value-" + k) for k in declared])
    (resources,) = task.resources
    out[path] = {
        "name": task.name, "num_nodes": task.num_nodes, "workdir": task.workdir,
        "accelerators": resources.accelerators, "use_spot": resources.use_spot,
        "envs": dict(task.envs), "declared_secrets": declared, "secrets": sorted(with_secrets.secrets),
        "storage": {dst: {"name": s.name, "mode": s.mode.value} for dst, s in task.storage_mounts.items()},
        "setup": task.setup, "run": task.run,
    }
launch = command.cli.commands["launch"]
options = sorted({o for p in launch.params for o in (*p.opts, *p.secondary_opts)})
print(json.dumps({"tasks": out, "launch_options": options}))
"""


def _skypilot_dir() -> Path:
    path = Path(os.environ.get("RLHFKIT_SKYPILOT_PKGS", Path(sys.prefix) / "skypilot-pkgs"))
    if not (path / "sky" / "__init__.py").is_file():
        pytest.fail(f"SkyPilot (a test dependency) is not in {path}: run `make install`, which installs it there "
                    "with `pip install --target`")
    return path


@pytest.fixture(scope="module")
def sky_view(tmp_path_factory) -> dict:
    home = tmp_path_factory.mktemp("sky_home")  # sky writes ~/.sky on import
    env = {**os.environ, "PYTHONPATH": str(_skypilot_dir()), "HOME": str(home), "PYTHONNOUSERSITE": "1"}
    proc = subprocess.run([sys.executable, "-c", _LOADER, *map(str, YAMLS)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _flat(cfg) -> dict:
    """Flag name -> value of a parsed config (its sections flattened, as the flags are)."""
    if not dataclasses.is_dataclass(cfg):
        return vars(cfg)
    values = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        values.update(_flat(value) if dataclasses.is_dataclass(value) else {f.name: value})
    return values


def _node_env(task: dict, rank: int) -> dict[str, str]:
    """What SkyPilot gives a node: the task's envs and secrets plus its node variables."""
    nodes = task["num_nodes"]
    (gpus,) = task["accelerators"].values()
    return {**task["envs"], **{k: f"value-{k}" for k in task["secrets"]},
            "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": str(nodes),
            "SKYPILOT_NODE_IPS": "\n".join(f"127.0.0.{i + 1}" for i in range(nodes)),
            "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus), "SKYPILOT_TASK_ID": "test-task"}


def _run_on_every_node(task: dict, tmp_path: Path) -> dict[int, list]:
    """Setup then run, per node rank, under stubs; returns each rank's recorded calls."""
    per_rank = {}
    for rank in range(task["num_nodes"]):
        calls = []
        for stage in ("setup", "run"):
            result = run_with_stubs(task[stage], _node_env(task, rank), tmp_path / f"rank{rank}-{stage}", cwd=REPO)
            assert result.returncode == 0, f"{stage} on rank {rank} failed: {result.stderr}"
            calls += result.calls
        per_rank[rank] = calls
    return per_rank


def test_every_task_file_is_found():
    assert {p.name for p in YAMLS} >= {"sft.yaml", "rm.yaml", "dpo.yaml", "ppo.yaml"}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_task_loads_with_skypilot_and_its_rlhfkit_commands_parse(path, sky_view, tmp_path):
    task = sky_view["tasks"][str(path)]
    # OpenRLHF's shape: 8 A100s per node, spot by default, secrets by --secret, checkpoints on a bucket mount
    assert task["accelerators"] == {"A100": 8}
    assert task["use_spot"] is True
    assert "WANDB_TOKEN" in task["declared_secrets"] and task["secrets"] == task["declared_secrets"]
    assert not {"WANDB_TOKEN", "HF_TOKEN"} & set(task["envs"]), "tokens must be secrets, not envs"
    assert task["storage"]["/checkpoints"] == {"name": task["envs"]["CKPT_BUCKET"], "mode": "MOUNT_CACHED"}
    assert task["workdir"] == "."

    per_rank = _run_on_every_node(task, tmp_path)
    head = rlhfkit_calls(per_rank[0])
    assert head, f"{path.name} runs no rlhfkit command on the head node"
    for call in head:
        command = catalog.by_module(call.module)
        assert command is not None, f"{path.name}: rlhfkit.cli.{call.module} is not a registered command"
        try:
            cfg = catalog.parse_flags(command, call.argv)
        except SystemExit as e:  # argparse already wrote the bad flag to stderr
            pytest.fail(f"{path.name}: {call.launcher} rlhfkit.cli.{call.module} rejects its flags (exit {e.code})")
        values = _flat(cfg)
        assert values["save_path"].startswith("/checkpoints/"), "the model must land on the bucket"
        assert values["ckpt_path"].startswith("/checkpoints/") and values["load_checkpoint"], "resumable on spot"
        assert values["use_wandb"] == "value-WANDB_TOKEN", "W&B key comes from the secret"
    for rank in range(1, task["num_nodes"]):
        assert not rlhfkit_calls(per_rank[rank]), "workers join Ray; only the head submits the job"


def test_ppo_task_builds_a_multi_node_ray_cluster_and_submits_the_hybrid_engine(sky_view, tmp_path):

    task = sky_view["tasks"][str(TASKS / "ppo.yaml")]
    assert task["num_nodes"] >= 2
    per_rank = _run_on_every_node(task, tmp_path)
    ray_calls = {rank: [c[1:] for c in calls if c[0] == "ray"] for rank, calls in per_rank.items()}
    head_ip, port = "127.0.0.1", task["envs"]["RAY_PORT"]
    head_start = next(a for a in ray_calls[0] if a[0] == "start")
    assert "--head" in head_start and head_start[head_start.index("--port") + 1] == port
    assert head_start[head_start.index("--num-gpus") + 1] == "8"
    for rank in range(1, task["num_nodes"]):
        start = next(a for a in ray_calls[rank] if a[0] == "start")
        assert start[start.index("--address") + 1] == f"{head_ip}:{port}", "workers join the head (rank 0) IP"
        assert "--head" not in start
    for calls in ray_calls.values():  # SkyPilot's own Ray holds 6380, 8266 and agent port 52365 on every node
        start = next(a for a in calls if a[0] == "start")
        assert start[start.index("--dashboard-agent-listen-port") + 1] not in ("52365", "")
        assert port != "6380"
    submit = next(a for a in ray_calls[0] if a[:2] == ["job", "submit"])
    runtime_env = json.loads(submit[submit.index("--runtime-env-json") + 1])
    assert "NCCL_DEBUG" in runtime_env["env_vars"]

    (call,) = rlhfkit_calls(per_rank[0])
    assert (call.module, call.launcher) == ("train_ppo_ray", "ray job submit")
    cfg = catalog.parse_flags(catalog.by_module("train_ppo_ray"), call.argv)  # parsing validates the flags
    cfg.check_inputs()
    v = _flat(cfg)
    assert v["colocate_all_models"] and v["vllm_enable_sleep"] and v["deepspeed_enable_sleep"]  # hybrid engine
    assert v["actor_num_nodes"] * v["actor_num_gpus_per_node"] == task["num_nodes"] * 8
    assert v["vllm_num_engines"] * v["vllm_tensor_parallel_size"] == task["num_nodes"] * 8


def _launch(tmp_path: Path, env: dict[str, str], *args: str):
    return run_with_stubs(shlex.join([str(TASKS / "launch.sh"), *args]), env, tmp_path, cwd=REPO)


@pytest.mark.parametrize(("use_spot", "flag"), [(None, "--use-spot"), ("1", "--use-spot"), ("0", "--no-use-spot")])
def test_launch_script_switches_spot_and_passes_secrets_with_skypilots_own_options(use_spot, flag, sky_view,
                                                                                   tmp_path):
    env = {"WANDB_TOKEN": "w", **({"USE_SPOT": use_spot} if use_spot else {})}
    result = _launch(tmp_path, env, "sft.yaml", "--num-nodes", "1")
    assert result.returncode == 0, result.stderr
    ((name, *args),) = result.calls
    assert name == "sky" and args[:3] == ["launch", "-c", "rlhfkit-sft"]
    assert Path(args[3]) == TASKS / "sft.yaml" and args[4] == flag
    assert args[5:] == ["--secret", "WANDB_TOKEN", "--num-nodes", "1"], "unset HF_TOKEN is not passed"
    assert "w" not in args, "the secret's value never goes on the command line"
    options = set(sky_view["launch_options"])
    assert {a for a in args if a.startswith("--")} <= options


def test_launch_script_rejects_a_bad_switch_and_an_unknown_task(tmp_path):
    bad = _launch(tmp_path / "a", {"USE_SPOT": "maybe"}, "sft.yaml")
    assert bad.returncode == 2 and "USE_SPOT must be 1 or 0" in bad.stderr and not bad.calls
    missing = _launch(tmp_path / "b", {}, "nope.yaml")
    assert missing.returncode == 2 and "no task file nope.yaml" in missing.stderr and "sft.yaml" in missing.stderr
