"""The Slurm recipe (deploy/slurm/ppo.sbatch): bash accepts it, it starts Ray on every node of the allocation (the
head on the first node, the others as workers joining the head's IP), and the train_ppo_ray job it submits parses
through rlhfkit's own parser with role sizes that follow the allocation.

The script runs under real bash with Slurm's and Ray's commands replaced by recorders (`tests.deploy.shell_stubs`):
`scontrol show hostnames` answers with the test's node list and `srun ... hostname --ip-address` with an IP."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rlhfkit.cli import catalog
from tests.deploy.shell_stubs import rlhfkit_calls, run_with_stubs
from tests.deploy.test_skypilot import _flat

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "ppo.sbatch"
HEAD_IP = "10.1.2.3"
RECORD = """printf '%s\\0' "${0##*/}" "$@" $'\\036' >> "$STUB_CALLS"\n"""


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{RECORD}{body}\n")
    path.chmod(0o755)


def _run(tmp_path: Path, nodes: list[str]):
    """The batch script on a `nodes` allocation (8 GPUs each), Slurm and Ray stubbed; its run and recorded calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    _stub(bin_dir, "scontrol", f'[ "$1 $2" = "show hostnames" ] && printf "%s\\n" {" ".join(nodes)}')
    _stub(bin_dir, "srun", f'case " $* " in *" hostname --ip-address "*) echo "{HEAD_IP}";; esac')
    env = {"SLURM_JOB_NODELIST": f"gpu[1-{len(nodes)}]", "SLURM_JOB_NUM_NODES": str(len(nodes)),
           "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_PER_TASK": "64", "SLURM_SUBMIT_DIR": "/shared/rlhfkit"}
    return run_with_stubs(f"source {SBATCH}", env, tmp_path, cwd=REPO)


def test_the_sbatch_script_is_valid_bash_with_slurm_directives():
    assert subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True).returncode == 0
    directives = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --nodes=2" in directives and "#SBATCH --ntasks-per-node=1" in directives


@pytest.mark.parametrize("nodes", [["gpu1", "gpu2"], ["gpu1", "gpu2", "gpu3", "gpu4"]], ids=["2-nodes", "4-nodes"])
def test_ray_head_on_the_first_node_workers_join_it_and_the_job_parses(nodes, tmp_path):
    result = _run(tmp_path, nodes)
    assert result.returncode == 0, result.stderr
    steps = [c[c.index("ray") + 1:] + ["@", c[c.index("-w") + 1]] for c in result.calls
             if c[0] == "srun" and "ray" in c]
    starts = {s[-1]: s[:-2] for s in steps if s[0] == "start"}
    assert set(starts) == set(nodes), "one Ray start per node of the allocation"
    head = starts[nodes[0]]
    assert "--head" in head and head[head.index("--node-ip-address") + 1] == HEAD_IP and "--block" in head
    for node in nodes[1:]:
        worker = starts[node]
        assert "--head" not in worker and worker[worker.index("--address") + 1] == f"{HEAD_IP}:6379"
        assert "--block" in worker and worker[worker.index("--num-gpus") + 1] == "8"

    submit = next(c[1:] for c in result.calls if c[:3] == ["ray", "job", "submit"])
    assert submit[submit.index("--address") + 1] == f"http://{HEAD_IP}:8265"
    runtime_env = json.loads(submit[submit.index("--runtime-env-json") + 1])
    assert runtime_env["working_dir"] == "/shared/rlhfkit"
    (call,) = rlhfkit_calls(result.calls)
    assert (call.module, call.launcher) == ("train_ppo_ray", "ray job submit")
    cfg = catalog.parse_flags(catalog.by_module("train_ppo_ray"), call.argv)  # parsing validates the flags
    cfg.check_inputs()
    v = _flat(cfg)
    gpus = 8 * len(nodes)
    assert v["actor_num_nodes"] == len(nodes) and v["actor_num_nodes"] * v["actor_num_gpus_per_node"] == gpus
    assert v["vllm_num_engines"] * v["vllm_tensor_parallel_size"] == gpus
    assert v["load_checkpoint"] and v["use_ds_universal_ckpt"] and v["ckpt_path"].startswith("/shared/rlhfkit/")
