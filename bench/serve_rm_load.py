"""serve_rm under load and abuse, on 127.0.0.1 (issue: "a server that holds").

Starts `python -m rlhfkit.cli.serve_rm` on the demo's tiny model (a fresh value head, seeded) as a real
subprocess, then:
1. 200 requests from 20 concurrent clients (4 queries each), every answer checked against the same model scored
   in this process one text at a time; p50/p99 latency;
2. abuse: a 50 MB body, 10,000 queries in one request, malformed JSON, a slow client sending a byte a second;
   each must get a clear 4xx (or be timed out) while
3. a probe request keeps getting correct answers during and after each abuse.
Writes bench/results/serve_rm_load.md. Run: `.venv/bin/python bench/serve_rm_load.py` (about a minute).
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


def post(port: int, body: bytes, timeout: float = 120) -> tuple[int, dict, float]:
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/get_reward", body=body, headers={"Content-Type": "application/json"})
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
        sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n")
        try:
            for byte in body:
                sock.sendall(bytes([byte]))
                time.sleep(1.0)
        except OSError:
            pass  # the server answered and closed
        return sock.recv(65536).decode(errors="replace").split("\r\n")[0]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        rm = build_reward_model(Path(tmp))
        truth = reference(rm, QUERIES)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = subprocess.Popen([sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward_pretrain", str(rm),
                                   "--port", "0", "--max_len", "64", "--batch_size", "32",
                                   "--max_body_bytes", str(10 * 2**20), "--max_queries_per_request", "4096",
                                   "--client_timeout", "10"],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
        try:
            line = server.stdout.readline()
            port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
            rows = []
            # 1. load
            jobs = [[QUERIES[(i * 4 + k) % len(QUERIES)] for k in range(4)] for i in range(200)]
            with ThreadPoolExecutor(max_workers=20) as pool:
                started = time.perf_counter()
                results = list(pool.map(lambda q: post(port, json.dumps({"query": q}).encode()), jobs))
                wall = time.perf_counter() - started
            correct = sum(status == 200 and all(abs(a - truth[q]) < 1e-4 for a, q in zip(ans["rewards"], query))
                          for query, (status, ans, _) in zip(jobs, results))
            latencies = sorted(r[2] for r in results)
            p50 = statistics.median(latencies)
            p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
            rows.append(("200 requests x 4 queries, 20 concurrent clients", f"{correct}/200 correct",
                         f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, {200 / wall:.0f} req/s", "-"))
            # 2. abuse, each followed by a probe
            abuses = [
                ("a 50 MB body", lambda: post(port, json.dumps({"query": ["x" * 50 * 2**20]}).encode())),
                ("10,000 queries in one request", lambda: post(port, json.dumps({"query": ["q"] * 10_000}).encode())),
                ("malformed JSON", lambda: post(port, b'{"query": [unquoted]}')),
                ("a lone surrogate", lambda: post(port, b'{"query": ["\\ud800"]}')),
                ("JSON nested 100,000 deep", lambda: post(port, b"[" * 100_000 + b"]" * 100_000)),
            ]
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
        finally:
            server.terminate()
            server.wait(timeout=30)
    versions = {m: __import__(m).__version__ for m in ("torch", "transformers")}
    lines = [f"# serve_rm under load and abuse ({date.today()})", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
             f"torch {versions['torch']}, transformers {versions['transformers']}; load average at the end "
             f"{os.getloadavg()[0]:.1f}. Server: `python -m rlhfkit.cli.serve_rm` on the demo's tiny model "
             "(1.5M params), --batch_size 32, one scoring worker, on 127.0.0.1.", "",
             "| what | answer | detail | correct scores after |", "| --- | --- | --- | --- |"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    out = REPO / "bench" / "results" / "serve_rm_load.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r[3] in ("ok", "-") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
