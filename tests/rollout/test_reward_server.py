"""The reward-model HTTP server: exact rewards, concurrent batching, validation, auth, and staying up."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO

QUERIES = ["User: What is 1+2?\nAssistant: 3", "User: What is 10+5?\nAssistant: 16",
           "User: Reverse the letters of abc.\nAssistant: cba", "x"]


@pytest.fixture(scope="module")
def reward_dir(demo_assets, tmp_path_factory) -> Path:
    """A reward model directory like train_rm writes: the demo backbone, a seeded head, reward statistics."""
    from rlhfkit.models.value_model import load_value_model

    torch.manual_seed(0)
    model = load_value_model(str(demo_assets.model_dir), flag="--pretrain")
    model.config.reward_mean, model.config.reward_std, model.config.normalize_reward = 0.5, 2.0, False
    out = tmp_path_factory.mktemp("rm")
    model.save_pretrained(out)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(demo_assets.model_dir).save_pretrained(out)
    return out


def expected_rewards(path: Path, texts: list[str]) -> list[float]:
    """In-process reference: one text at a time, bos + text + eos, the head at the last token."""
    from transformers import AutoTokenizer

    from rlhfkit.models.value_model import load_value_model

    tok = AutoTokenizer.from_pretrained(path)
    model = load_value_model(str(path)).eval()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = [tok.bos_token_id, *tok.encode(text, add_special_tokens=False), tok.eos_token_id]
            hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state
            out.append(model.score(hidden)[0, -1, 0].item())
    return out


def request(port: int, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def post(port: int, payload, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return request(port, "POST", "/get_reward", body, {"Content-Type": "application/json", **(headers or {})})


@pytest.fixture(scope="module")
def server(reward_dir):
    from rlhfkit.rollout.reward_server import RewardServer, load_scorer

    scorer = load_scorer(str(reward_dir), max_len=64, batch_size=8)
    srv = RewardServer(scorer, port=0, batch_wait_ms=20, max_body_bytes=4096).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_rewards_match_the_in_process_model(server, reward_dir):
    status, answer = post(server.port, {"query": QUERIES, "prompts": ["ignored"], "labels": [None]})
    assert status == 200
    assert answer["rewards"] == pytest.approx(expected_rewards(reward_dir, QUERIES), abs=1e-5)
    assert server.url == f"http://127.0.0.1:{server.port}/get_reward"
    assert request(server.port, "GET", "/health") == (200, {"status": "ok"})


def test_fifty_concurrent_requests_all_succeed_and_are_batched(server, reward_dir):
    truth = dict(zip(QUERIES, expected_rewards(reward_dir, QUERIES)))
    before = server.worker.batches_run
    jobs = [[QUERIES[i % 4], QUERIES[(i + 1) % 4]] for i in range(50)]
    with ThreadPoolExecutor(max_workers=50) as pool:
        results = list(pool.map(lambda q: post(server.port, {"query": q}), jobs))
    for query, (status, answer) in zip(jobs, results):
        assert status == 200
        assert answer["rewards"] == pytest.approx([truth[q] for q in query], abs=1e-5)
    assert server.worker.batches_run - before < 50  # requests were merged into shared forward passes


@pytest.mark.parametrize("body, code", [
    (b"{not json", 400), (b"\xff\xfe", 400), (b"[1, 2]", 400), (b'{"queries": ["a"]}', 400),
    (b'{"query": "a"}', 400), (b'{"query": []}', 400), (b'{"query": ["a", 3]}', 400),
    (b'{"query": [null]}', 400), (json.dumps({"query": ["a" * 5000]}).encode(), 413),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, code):
    status, answer = post(server.port, body)
    assert status == code and "error" in answer
    assert post(server.port, {"query": ["ok"]})[0] == 200


def test_unknown_path_and_method(server):
    assert request(server.port, "GET", "/nope")[0] == 404
    assert request(server.port, "POST", "/other", b"{}", {"Content-Type": "application/json"})[0] == 404
    assert post(server.port, {"query": ["still up"]})[0] == 200


def test_bearer_token_is_required_when_set(reward_dir):
    from rlhfkit.rollout.reward_server import RewardServer, load_scorer

    with RewardServer(load_scorer(str(reward_dir), max_len=64), port=0, api_key="s3cret") as srv:
        assert post(srv.port, {"query": ["a"]})[0] == 401
        assert post(srv.port, {"query": ["a"]}, {"Authorization": "Bearer wrong"})[0] == 401
        assert post(srv.port, {"query": ["a"]}, {"Authorization": "Basic s3cret"})[0] == 401
        status, answer = post(srv.port, {"query": ["a"]}, {"Authorization": "Bearer s3cret"})
        assert status == 200 and len(answer["rewards"]) == 1
        assert request(srv.port, "GET", "/health")[0] == 200


def test_normalized_rewards_use_the_saved_statistics(reward_dir):
    from rlhfkit.rollout.reward_server import load_scorer

    raw = load_scorer(str(reward_dir), max_len=64).score(QUERIES)
    normalized = load_scorer(str(reward_dir), max_len=64, normalize=True).score(QUERIES)
    assert normalized == pytest.approx([(r - 0.5) / 2.0 for r in raw], abs=1e-6)


def test_cli_prints_its_url_and_serves(reward_dir):
    from rlhfkit.distributed.launch import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward_pretrain", str(reward_dir), "--port", str(port),
           "--max_len", "64"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**__import__("os").environ, "RLHFKIT_RM_API_KEY": "k"})
    try:
        line, deadline = "", time.monotonic() + 120
        while "ready" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/get_reward" in line, line
        assert post(port, {"query": ["a"]})[0] == 401
        status, answer = post(port, {"query": QUERIES}, {"Authorization": "Bearer k"})
        assert status == 200
        assert answer["rewards"] == pytest.approx(expected_rewards(reward_dir, QUERIES), abs=1e-5)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
    assert proc.returncode == 0  # SIGTERM stops it cleanly


def test_cli_bad_model_path_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward_pretrain", str(tmp_path / "no"),
                           "--port", "0"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--reward_pretrain" in proc.stderr
