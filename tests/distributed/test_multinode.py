"""train_ppo_ray on a Ray cluster of four nodes on this machine (a `ray start --head` and three `ray start --address`
workers, one CPU each, so every bundle lands on its own node), submitted as OpenRLHF's example commands submit it:
`ray job submit --address ... --runtime-env-json '{"working_dir": ...}' -- python3 -m ...train_ppo_ray`.

The actor's two ranks train on two nodes (their process group crosses nodes), the reference sits on a third and the
rollout engine on the fourth, so every weight sync crosses nodes; the run writes where each part ran
(placement.json) and the test checks it against the cluster's own node list. Then a second run loses the node of the
actor's second rank after its first checkpoint: it stops within 60 s with one line naming the role and the node, and
its rerun with --load_checkpoint on the restored cluster finishes. The cluster runs in a network namespace of its
own (tests/distributed/multinode_cluster.py says why)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.test_train_ppo_ray import argv
from tests.helpers import REPO

CLUSTER = Path(__file__).with_name("multinode_cluster.py")


def in_own_network(*command: str) -> list[str]:
    """`command` in a new network namespace (a user namespace too when not root)."""
    unshare = ["unshare", "--net"] if os.geteuid() == 0 else ["unshare", "--net", "--map-root-user"]
    return [*unshare, "--", *command]


def namespaces_work() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    probe = subprocess.run(in_own_network("ip", "link", "set", "lo", "up"), capture_output=True, timeout=30)
    return probe.returncode == 0


def with_flag(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return args[:i + 1] + [value] + args[i + 2:]


@pytest.mark.limit(900)
def test_four_nodes_job_submit_then_a_lost_node_and_the_resume(demo_assets, tmp_path):
    if not namespaces_work():
        pytest.skip("needs `unshare --net` and `ip` (util-linux, iproute2) to keep the cluster off the network")
    out, lost = tmp_path / "run", tmp_path / "lost"
    spread = ("--actor_num_nodes", "2", "--ref_num_nodes", "1", "--advantage_estimator", "group_norm",
              "--vllm_num_engines", "0", "--init_kl_coef", "0.01", "--use_kl_loss")
    job = [str(Path(sys.executable).with_name("ray")), "job", "submit", "--address", "{dashboard}",
           "--runtime-env-json", json.dumps({"working_dir": str(REPO)}), "--", sys.executable, "-m",
           "rlhfkit.cli.train_ppo_ray", *argv(demo_assets, out, *spread)]
    # 4 steps, a checkpoint after each: the node of the actor's second rank is lost after the first one (the kill
    # lands within a second of it, three steps before the run could end), and the rerun trains steps 2-4
    driver = ["env", "RAY_ADDRESS={gcs}", sys.executable, "-m", "rlhfkit.cli.train_ppo_ray",
              *with_flag(argv(demo_assets, lost, *spread, "--ckpt_path", str(tmp_path / "ckpt"), "--save_steps", "1"),
                         "--max_samples", "8")]
    spec = {"workers": 3, "job": job, "kill": {"role": "actor", "ckpt": str(tmp_path / "ckpt"),
                                               "placement": str(lost / "placement.json"), "driver": driver}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(in_own_network(sys.executable, str(CLUSTER), str(tmp_path / "cluster"),
                                        str(tmp_path / "spec.json")),
                         capture_output=True, text=True, timeout=880, env=env, cwd=REPO)
    log = run.stdout[-4000:] + run.stderr[-3000:]
    assert run.returncode == 0, log
    result = json.loads((tmp_path / "cluster" / "cluster.json").read_text())
    nodes = result["nodes"]

    # 1. the job: roles on four nodes, the weight sync across nodes
    assert result["job"] == 0 and "succeeded" in run.stdout, log
    assert "_ray_pkg_" in run.stdout + run.stderr, log  # the working_dir was uploaded
    assert "4 nodes: actor on" in run.stdout, log
    placement = json.loads((out / "placement.json").read_text())
    roles = placement["roles"]
    assert set(placement["nodes"]) == set(nodes) and len(nodes) == 4  # the cluster's own node ids
    assert len(roles["actor"]) == 2 and len(set(roles["actor"])) == 2  # two ranks, two nodes
    assert len({*roles["actor"], *roles["ref"], *roles["engine"]}) == 4  # every part on a node of its own
    assert roles["engine"][0] not in roles["actor"]  # the weight sync crosses nodes
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/actor/policy_loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    # step 2 sampled after a weight sync from the actor's node to the engine's: the log-probs agree
    assert steps[1]["train/rollout_logprob_diff"] < 1e-4
    assert (out / "model.safetensors").is_file()

    # 2. a lost node stops the run within 60 s, with one line naming the role and the node
    kill = result["kill"]
    assert kill["returncode"] not in (0, None) and kill["seconds_to_stop"] < 60, kill
    errors = [line for line in kill["log"].splitlines() if "its Ray actor died" in line]
    role = "rollout engine" if kill["role"] == "engine" else f"{kill['role']} role"
    assert errors and role in errors[-1] and f"node 127.0.0.1/{kill['killed_node'][:8]}" in errors[-1], \
        kill["log"][-3000:]
    assert "Traceback" not in kill["log"], kill["log"][-3000:]

    # 3. the rerun with --load_checkpoint on the restored cluster finishes
    assert result["resume"]["returncode"] == 0, result["resume"]["log"]
    resumed = [json.loads(line) for line in (lost / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in resumed if "train/actor/policy_loss" in r) == 4
    assert (lost / "model.safetensors").is_file()
