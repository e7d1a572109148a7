"""A Ray cluster of several nodes on this machine, for one command, inside a network namespace of its own.

    unshare --net -- python tests/distributed/multinode_cluster.py OUT_DIR SPEC.json

Ray binds every interface once multi-node is enabled (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, which `ray start
--address` needs), so the cluster lives in a network namespace whose only interface is loopback: nothing of it can
be reached from outside the test. The script brings loopback up, starts a head (`ray start --head`, one CPU, the job
server) and `workers` nodes (`ray start --address`, one CPU each), waits until all are alive, then
1. runs the `job` command (`{dashboard}` is the job server's URL, `{gcs}` the cluster address), again while the job
   server says "No available agent", and prints its output;
2. with `kill` ({"role", "ckpt", "placement", "driver"}): starts the driver command, SIGKILLs the worker node of
   the role's last rank (the head holds the job server: another role's node when the role sits there) once the
   run's first checkpoint is complete, times how long the driver takes to stop, starts a
   replacement node and reruns the driver with --load_checkpoint.
OUT_DIR/cluster.json holds the alive nodes ({node id: IP}) and what each phase returned. The cluster is stopped on
exit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers import start_ray_head, start_ray_worker, stop_ray_head  # noqa: E402


def alive_nodes(gcs_port: int, env: dict[str, str], field: str = "NodeManagerAddress") -> dict:
    """{node id: `field` of its `ray.nodes()` entry} of the alive nodes, asked from a fresh driver."""
    code = (f"import json, ray; ray.init(address='127.0.0.1:{gcs_port}', logging_level='ERROR'); "
            f"print(json.dumps({{n['NodeID']: n[{field!r}] for n in ray.nodes() if n['Alive']}}))")
    return _json_line(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     timeout=120).stdout)


def _json_line(stdout: str) -> dict:
    """The JSON object a probe printed (Ray may print log lines around it); {} when there is none yet."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                return dict(json.loads(line))
            except ValueError:
                continue
    return {}


def wait_for_dashboard(port: int, deadline: float) -> None:
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("the Ray job server did not come up")


def node_processes(gcs: int, env: dict[str, str], workers: list[subprocess.Popen]) -> dict[str, subprocess.Popen]:
    """{Ray node id: its `ray start` process} of the worker nodes, matched by their node-manager ports."""
    ports = alive_nodes(gcs, env, "NodeManagerPort")
    by_port = {int(w.args[w.args.index("--node-manager-port") + 1]): w for w in workers}
    return {node: by_port[port] for node, port in ports.items() if port in by_port}


def run_job(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    for _ in range(60):  # the job server answers before the head's job agent is up: "No available agent"
        done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
        if "No available agent" not in done.stdout + done.stderr:
            break
        time.sleep(1)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done


def lose_machine(node: subprocess.Popen) -> None:
    """SIGKILL everything of a node at once, as a lost machine: its `ray start`, the raylet and every worker process
    the raylet started (actors talk to each other directly, so a dead raylet alone would not stop them)."""
    import psutil

    root = psutil.Process(node.pid)
    everything = [root, *root.children(recursive=True)]
    for process in everything:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def lose_a_node(spec: dict, gcs: int, env: dict[str, str], workers: list[subprocess.Popen], out: Path) -> dict:
    """Start the driver, SIGKILL a worker node that holds a rank of `spec["role"]` (the last such rank; else of the
    first role on a worker node) once the run's first checkpoint is complete, and time how long the driver takes to
    stop."""
    ckpt, placement = Path(spec["ckpt"]), Path(spec["placement"])
    processes = node_processes(gcs, env, workers)  # before the run: the kill must not wait for a probe
    with open(out / "killed_run.log", "w") as log:
        driver = subprocess.Popen(spec["driver"], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 400
        while not ((ckpt / "latest").is_file() and placement.is_file()):
            if driver.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the run ended or stalled before its first checkpoint: {driver.poll()}")
            time.sleep(0.2)
        roles = json.loads(placement.read_text())["roles"]
        order = [spec["role"]] + [r for r in roles if r != spec["role"]]
        role, node = next((r, n) for r in order for n in reversed(roles[r]) if n in processes)
        victim = processes[node]
        lose_machine(victim)
        killed = time.time()
        try:
            code = driver.wait(timeout=180)
        except subprocess.TimeoutExpired:
            driver.kill()
            code = None
    return {"role": role, "killed_node": node, "killed_worker": workers.index(victim), "returncode": code,
            "seconds_to_stop": time.time() - killed, "log": (out / "killed_run.log").read_text()[-6000:]}


def main(out: Path, spec: dict) -> int:
    from rlhfkit.distributed.launch import free_port

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out.mkdir(parents=True, exist_ok=True)
    dashboard = free_port()
    head, gcs, ray_tmp = start_ray_head(out / "head.log", env, dashboard_port=dashboard, num_cpus=1)
    workers: list[subprocess.Popen] = []
    result: dict = {}

    def fill(argv: list[str]) -> list[str]:
        return [a.replace("{dashboard}", f"http://127.0.0.1:{dashboard}").replace("{gcs}", f"127.0.0.1:{gcs}")
                for a in argv]

    def add_node(log: Path) -> None:
        """One more worker node, started after the others are up (several raylets starting at once on a loaded
        2-core machine can miss Ray's start-up deadline); a node that dies starting is started again, once."""
        for attempt in range(2):
            worker = start_ray_worker(gcs, log.with_suffix(f".{attempt}.log"), env)
            deadline = time.time() + 180
            while worker.poll() is None and len(alive_nodes(gcs, env)) < 2 + len(workers):
                if time.time() > deadline:
                    raise TimeoutError(f"Ray node {log.stem} did not come up")
                time.sleep(2)
            if worker.poll() is None:
                workers.append(worker)
                return
        raise RuntimeError(f"Ray node {log.stem} failed to start twice: see {log.parent}")

    try:
        wait_for_dashboard(dashboard, time.time() + 240)
        for i in range(spec["workers"]):
            add_node(out / f"worker{i}.log")
        result["nodes"] = alive_nodes(gcs, env)
        result["job"] = run_job(fill(spec["job"]), env).returncode
        if "kill" in spec:
            kill = {**spec["kill"], "driver": fill(spec["kill"]["driver"])}
            result["kill"] = lose_a_node(kill, gcs, env, workers, out)
            workers.remove(workers[result["kill"]["killed_worker"]])
            deadline = time.time() + 180
            while result["kill"]["killed_node"] in alive_nodes(gcs, env):  # until the cluster has seen it go
                if time.time() > deadline:
                    raise TimeoutError("the cluster never marked the lost node dead")
                time.sleep(2)
            add_node(out / "replacement.log")  # the lost machine comes back
            resumed = subprocess.run(kill["driver"] + ["--load_checkpoint"], env=env, cwd=REPO, capture_output=True,
                                     text=True, timeout=400)
            result["resume"] = {"returncode": resumed.returncode, "log": (resumed.stdout + resumed.stderr)[-6000:]}
        (out / "cluster.json").write_text(json.dumps(result))
        return 0
    finally:
        for node in reversed([head, *workers]):
            stop_ray_head(node)
        for node in workers:  # their temp dirs (tests.helpers.start_ray_worker)
            shutil.rmtree(node.args[node.args.index("--temp-dir") + 1], ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())))
