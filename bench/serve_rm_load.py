"""serve_rm under load and abuse, on 127.0.0.1 (issue: "a server that holds").

Starts `python -m rlhfkit.cli.serve_rm` on the demo's tiny model (a fresh value head, seeded) as a real
subprocess with a bearer token, then:
1. 200 requests from 20 concurrent clients (4 queries each), every answer checked against the same model scored
   in this process one text at a time; p50/p99 latency;
2. fairness: 19 clients x 200 small requests (4 queries) alone, then again while a 20th client sends
   10,000-query requests back to back; the small requests' p99 under load against the p99 alone (target: < 2x);
3. abuse: a 50 MB body with and without the token, 10,000 queries over --max_queries_per_request, malformed
   JSON, a slow client sending a byte a second; each must get a clear 4xx (or be timed out) while
4. a probe request keeps getting correct answers during and after each abuse; 16 concurrent 10 MB bodies and
   the server's peak memory;
5. 1,000 idle connections: the server's threads and resident memory before and while they are open, a probe
   answered meanwhile, and the connections closed by the server after --keep_alive_timeout.
Writes bench/results/serve_rm_load.md. Run: `.venv/bin/python bench/serve_rm_load.py` (a few minutes).
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
QUERIES = [f"User: What is {a}+{b}?\nAssistant: {a + b}" for a in range(10) for b in range(5)]
KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def build_reward_model(root: Path) -> Path:
    from transformers import AutoTokenizer

    from rlhfkit.demo.assets import build_demo_assets
    from rlhfkit.models.value_model import load_value_model

    assets = build_demo_assets(root / "assets", seed=0)
    torch.manual_seed(0)
    model = load_value_model(str(assets.model_dir), flag="--pretrain", require_head=False)
    out = root / "rm"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(assets.model_dir).save_pretrained(out)
    return out


def reference(path: Path, texts: list[str]) -> dict[str, float]:
    from transformers import AutoTokenizer

    from rlhfkit.models.value_model import load_value_model

    tok = AutoTokenizer.from_pretrained(path)
    model = load_value_model(str(path)).eval()
    out = {}
    with torch.no_grad():
        for text in texts:
            ids = [tok.bos_token_id, *tok.encode(text, add_special_tokens=False), tok.eos_token_id]
            out[text] = model.score(model.model(input_ids=torch.tensor([ids])).last_hidden_state)[0, -1, 0].item()
    return out


def post(port: int, body: bytes, timeout: float = 300, token: bool = True) -> tuple[int, dict, float]:
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/get_reward", body=body,
                     headers={"Content-Type": "application/json", **(AUTH if token else {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}"), time.perf_counter() - started
    finally:
        conn.close()


def probe(port: int, truth: dict[str, float]) -> bool:
    status, answer, _ = post(port, json.dumps({"query": QUERIES[:2]}).encode())
    return status == 200 and all(abs(a - truth[q]) < 1e-4 for a, q in zip(answer["rewards"], QUERIES[:2]))


def slow_client(port: int, seconds: int) -> str:
    body = json.dumps({"query": ["slow"]}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=seconds + 60) as sock:
        sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                     b"Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        try:
            for byte in body:
                sock.sendall(bytes([byte]))
                time.sleep(1.0)
        except OSError:
            pass  # the server answered and closed
        return sock.recv(65536).decode(errors="replace").split("\r\n")[0]


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def load_rows(port: int, truth: dict[str, float]) -> list[tuple[str, str, str, str]]:
    jobs = [[QUERIES[(i * 4 + k) % len(QUERIES)] for k in range(4)] for i in range(200)]
    with ThreadPoolExecutor(max_workers=20) as pool:
        started = time.perf_counter()
        results = list(pool.map(lambda q: post(port, json.dumps({"query": q}).encode()), jobs))
        wall = time.perf_counter() - started
    correct = sum(status == 200 and all(abs(a - truth[q]) < 1e-4 for a, q in zip(ans["rewards"], query))
                  for query, (status, ans, _) in zip(jobs, results))
    latencies = [r[2] for r in results]
    return [("200 requests x 4 queries, 20 concurrent clients", f"{correct}/200 correct",
             f"p50 {statistics.median(latencies) * 1000:.0f} ms, p99 {p99(latencies) * 1000:.0f} ms, "
             f"{200 / wall:.0f} req/s", "-")]


def small_client(port: int, client: int, requests: int) -> list[float]:
    """`requests` small requests one after the other; their latencies (a refused one counts as infinite)."""
    out = []
    for i in range(requests):
        query = [QUERIES[(client * 7 + i * 4 + k) % len(QUERIES)] for k in range(4)]
        status, _, seconds = post(port, json.dumps({"query": query}).encode())
        out.append(seconds if status == 200 else float("inf"))
    return out


def fairness_rows(port: int, clients: int = 19, requests: int = 200) -> list[tuple[str, str, str, str]]:
    """Small requests' p99 alone, then beside one client sending 10,000-query requests back to back."""
    def small_phase() -> list[float]:
        with ThreadPoolExecutor(max_workers=clients) as pool:
            return [t for ts in pool.map(lambda c: small_client(port, c, requests), range(clients)) for t in ts]

    alone = small_phase()
    big_body = json.dumps({"query": [QUERIES[i % len(QUERIES)] for i in range(10_000)]}).encode()
    stop, big = [False], []

    def big_client() -> None:
        while not stop[0]:
            status, answer, seconds = post(port, big_body)
            big.append((status, len(answer.get("rewards", [])), seconds))

    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(big_client)
        time.sleep(0.5)  # the first big request is being scored when the small clients start
        loaded = small_phase()
        stop[0] = True
        running.result()
    ratio = p99(loaded) / p99(alone)
    big_ok = sum(status == 200 and n == 10_000 for status, n, _ in big)
    return [
        (f"{clients} clients x {requests} small requests (4 queries), alone", f"{len(alone)} requests",
         f"p50 {statistics.median(alone) * 1000:.0f} ms, p99 {p99(alone) * 1000:.0f} ms", "-"),
        ("the same beside a 20th client sending 10,000-query requests", f"{len(loaded)} requests, "
         f"{big_ok}/{len(big)} big ones answered in full",
         f"p50 {statistics.median(loaded) * 1000:.0f} ms, p99 {p99(loaded) * 1000:.0f} ms: {ratio:.2f}x the p99 "
         f"alone (target < 2x); a big request took {statistics.median([b[2] for b in big]):.1f} s",
         "ok" if ratio < 2 else "over 2x"),
    ]


def abuse_rows(port: int, truth: dict[str, float]) -> list[tuple[str, str, str, str]]:
    fifty_mb = json.dumps({"query": ["x" * 50 * 2**20]}).encode()
    abuses = [
        ("a 50 MB body without a token", lambda: post(port, fifty_mb, token=False)),
        ("a 50 MB body with the token", lambda: post(port, fifty_mb)),
        ("10,001 queries in one request", lambda: post(port, json.dumps({"query": ["q"] * 10_001}).encode())),
        ("malformed JSON", lambda: post(port, b'{"query": [unquoted]}')),
        ("a lone surrogate", lambda: post(port, b'{"query": ["\\ud800"]}')),
        ("JSON nested 100,000 deep", lambda: post(port, b"[" * 100_000 + b"]" * 100_000)),
    ]
    rows = []
    for name, call in abuses:
        status, answer, seconds = call()
        rows.append((name, f"HTTP {status}", f"{answer.get('error', '')[:90]} ({seconds:.2f} s)",
                     "ok" if probe(port, truth) else "WRONG"))
    with ThreadPoolExecutor(max_workers=1) as pool:  # the slow client, with probes while it trickles
        slow = pool.submit(slow_client, port, 20)
        during = [probe(port, truth) for _ in range(5) if not time.sleep(1.0)]
        first_line = slow.result()
    rows.append(("a slow client, a byte a second (--client_timeout 10)", first_line, "",
                 "ok" if all(during) and probe(port, truth) else "WRONG"))
    return rows


def process_figures(pid: int) -> tuple[int, float]:
    """(threads, resident MiB) of a process, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024


def bodies_rows(port: int, pid: int, truth: dict[str, float], count: int = 16) -> list[tuple[str, str, str, str]]:
    """`count` concurrent bodies just under --max_body_bytes (10 MB; cut short of valid JSON so none is scored):
    the server's peak resident memory (VmHWM) before and after."""
    peak_before = int(dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
                      ["VmHWM"].split()[0]) / 1024
    body = b'{"query": ["' + b"x" * (10 * 2**20 - 64)
    with ThreadPoolExecutor(max_workers=count) as pool:
        answers = list(pool.map(lambda _: post(port, body)[0], range(count)))
    peak = int(dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
               ["VmHWM"].split()[0]) / 1024
    return [(f"{count} concurrent 10 MB bodies (--max_concurrent_bodies 4)",
             f"HTTP {sorted(set(answers))}", f"peak resident memory {peak_before:.0f} -> {peak:.0f} MiB "
             f"(+{peak - peak_before:.0f} MiB)", "ok" if probe(port, truth) else "WRONG")]


def idle_rows(port: int, pid: int, truth: dict[str, float], count: int = 1000) -> list[tuple[str, str, str, str]]:
    threads_before, rss_before = process_figures(pid)
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]
    try:
        time.sleep(1.0)
        threads, rss = process_figures(pid)
        answered = probe(port, truth)
        time.sleep(7.0)  # past --keep_alive_timeout 5
        closed = 0
        for sock in idle:
            sock.settimeout(0.5)
            try:
                closed += sock.recv(1) == b""
            except OSError:
                pass
    finally:
        for sock in idle:
            sock.close()
    return [(f"{count:,} idle connections", f"threads {threads_before} -> {threads}",
             f"resident memory {rss_before:.0f} -> {rss:.0f} MiB (+{(rss - rss_before) * 1024 / count:.0f} KiB a "
             f"connection); {closed}/{count} closed by the server after --keep_alive_timeout 5",
             "ok" if answered and probe(port, truth) else "WRONG")]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        rm = build_reward_model(Path(tmp))
        truth = reference(rm, QUERIES)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RLHFKIT_RM_API_KEY": KEY}
        server = subprocess.Popen([sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward_pretrain", str(rm),
                                   "--port", "0", "--max_len", "64", "--batch_size", "32",
                                   "--max_body_bytes", str(10 * 2**20), "--max_queries_per_request", "10000",
                                   "--client_timeout", "10", "--max_connections", "2048"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        try:
            line = ""
            while "reward server ready" not in line and server.poll() is None:
                line = server.stdout.readline()
            port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
            rows = load_rows(port, truth)
            rows += fairness_rows(port)
            rows += abuse_rows(port, truth)
            rows += bodies_rows(port, server.pid, truth)
            rows += idle_rows(port, server.pid, truth)
        finally:
            server.terminate()
            server.wait(timeout=60)
    versions = {m: __import__(m).__version__ for m in ("torch", "transformers", "fastapi", "uvicorn")}
    lines = [f"# serve_rm under load and abuse ({date.today()})", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
             + ", ".join(f"{m} {v}" for m, v in versions.items()) + "; load average at the end "
             f"{os.getloadavg()[0]:.1f}. Server: `python -m rlhfkit.cli.serve_rm` (FastAPI on uvicorn) on the demo's "
             "tiny model (1.5M params), --batch_size 32, one scoring worker, a bearer token, on 127.0.0.1.", "",
             "| what | answer | detail | correct scores after |", "| --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    out = REPO / "bench" / "results" / "serve_rm_load.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r[3] in ("ok", "-") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
