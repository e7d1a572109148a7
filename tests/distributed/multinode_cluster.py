"""A Ray cluster of several nodes on this machine, for one command, inside a network namespace of its own.

    unshare --net -- python tests/distributed/multinode_cluster.py OUT_DIR WORKERS -- COMMAND...

Ray binds every interface once multi-node is enabled (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1, which `ray start
--address` needs), so the cluster lives in a network namespace whose only interface is loopback: nothing of it can
be reached from outside the test. The script brings loopback up, starts a head (`ray start --head`, one CPU, the job
server) and WORKERS nodes (`ray start --address`, one CPU each), waits until all are alive, runs COMMAND with
`{dashboard}` replaced by the job server's URL and `{gcs}` by the cluster address (again while the job server
says "No available agent"), prints its output and writes OUT_DIR/cluster.json:
the alive nodes ({node id: IP}) and the command's exit code. The cluster is stopped on exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers import start_ray_head, start_ray_worker, stop_ray_head  # noqa: E402


def alive_nodes(gcs_port: int, env: dict[str, str]) -> dict[str, str]:
    code = (f"import json, ray; ray.init(address='127.0.0.1:{gcs_port}', logging_level='ERROR'); "
            "print(json.dumps({n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else {}


def wait_for_dashboard(port: int, deadline: float) -> None:
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError("the Ray job server did not come up")


def main(out: Path, workers: int, command: list[str]) -> int:
    from rlhfkit.distributed.launch import free_port

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1", "RAY_AUTH_MODE": "disabled",
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out.mkdir(parents=True, exist_ok=True)
    dashboard = free_port()
    head, gcs, _ = start_ray_head(out / "head.log", env, dashboard_port=dashboard, num_cpus=1)
    nodes = [head]
    try:
        deadline = time.time() + 240
        wait_for_dashboard(dashboard, deadline)
        nodes += [start_ray_worker(gcs, out / f"worker{i}.log", env) for i in range(workers)]
        while len(alive := alive_nodes(gcs, env)) < 1 + workers:
            if time.time() > deadline:
                raise TimeoutError(f"{len(alive)} of {1 + workers} Ray nodes came up")
            time.sleep(2)
        argv = [a.replace("{dashboard}", f"http://127.0.0.1:{dashboard}").replace("{gcs}", f"127.0.0.1:{gcs}")
                for a in command]
        for _ in range(60):  # the job server answers before the head's job agent is up: "No available agent"
            done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
            if "No available agent" not in done.stdout + done.stderr:
                break
            time.sleep(1)
        sys.stdout.write(done.stdout)
        sys.stderr.write(done.stderr)
        (out / "cluster.json").write_text(json.dumps({"nodes": alive, "returncode": done.returncode}))
        return done.returncode
    finally:
        for node in reversed(nodes):
            stop_ray_head(node)


if __name__ == "__main__":
    split = sys.argv.index("--")
    sys.exit(main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[split + 1:]))
