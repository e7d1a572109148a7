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

from tests.helpers import REPO, error_lines

QUERIES = ["User: What is 1+2?\nAssistant: 3", "User: What is 10+5?\nAssistant: 16",
           "User: Reverse the letters of abc.\nAssistant: cba", "x"]


@pytest.fixture(scope="module")
def reward_dir(demo_assets, tmp_path_factory) -> Path:
    """A reward model directory like train_rm writes: the demo backbone, a seeded head, reward statistics."""
    from rlhfkit.models.value_model import load_value_model

    torch.manual_seed(0)
    model = load_value_model(str(demo_assets.model_dir), flag="--pretrain", require_head=False)
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
    from rlhfkit.rewards.scorer import load_scorer
    from rlhfkit.rewards.server import RewardServer

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
    from rlhfkit.rewards.scorer import load_scorer
    from rlhfkit.rewards.server import RewardServer

    with RewardServer(load_scorer(str(reward_dir), max_len=64), port=0, api_key="s3cret") as srv:
        assert post(srv.port, {"query": ["a"]})[0] == 401
        assert post(srv.port, {"query": ["a"]}, {"Authorization": "Bearer wrong"})[0] == 401
        assert post(srv.port, {"query": ["a"]}, {"Authorization": "Basic s3cret"})[0] == 401
        status, answer = post(srv.port, {"query": ["a"]}, {"Authorization": "Bearer s3cret"})
        assert status == 200 and len(answer["rewards"]) == 1
        assert request(srv.port, "GET", "/health")[0] == 200


def test_normalized_rewards_use_the_saved_statistics(reward_dir):
    from rlhfkit.rewards.scorer import load_scorer

    raw = load_scorer(str(reward_dir), max_len=64).score(QUERIES)
    normalized = load_scorer(str(reward_dir), max_len=64, normalize=True).score(QUERIES)
    assert normalized == pytest.approx([(r - 0.5) / 2.0 for r in raw], abs=1e-6)


def test_cli_prints_its_url_and_serves(reward_dir):
    from rlhfkit.distributed.launch import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward_pretrain", str(reward_dir), "--port", str(port),
           "--max_len", "64", "--api_key", ""]  # an empty flag (a script's unset variable) keeps the env key
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
                           "--port", "0", "--no_auth"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = error_lines(proc.stderr)  # the start-up notes on OpenRLHF's defaults left out
    assert len(lines) == 1 and "--reward_pretrain" in lines[0]


# -- abuse: malformed bodies, oversize requests, slow clients, starvation ---------------------------------------
@pytest.fixture(scope="module")
def guarded(reward_dir):
    """A server with small limits so each abuse is cheap to produce."""
    from rlhfkit.rewards.scorer import load_scorer
    from rlhfkit.rewards.server import RewardServer

    scorer = load_scorer(str(reward_dir), max_len=64, batch_size=8)
    srv = RewardServer(scorer, port=0, batch_wait_ms=5, max_body_bytes=2**20, max_queries_per_request=64,
                       client_timeout=2.0).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("body, fragment", [
    (b'{"query": ["\\ud800"]}', "lone UTF-16 surrogate"),
    (b'{"query": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
])
def test_malformed_unicode_and_deep_nesting_get_400(guarded, reward_dir, body, fragment):
    status, answer = post(guarded.port, body)
    assert status == 400 and fragment in answer["error"]
    assert post(guarded.port, {"query": QUERIES[:1]}) == (200, {"rewards": pytest.approx(
        expected_rewards(reward_dir, QUERIES[:1]), abs=1e-5)})


def test_too_many_queries_get_413_and_an_oversize_body_is_answered_not_reset(guarded):
    status, answer = post(guarded.port, {"query": ["a"] * 65})
    assert status == 413 and "over the limit of 64" in answer["error"]
    # 3 MB over a 1 MB limit: the server reads and drops the body, so the client gets the 413 (not EPIPE/RST)
    status, answer = post(guarded.port, json.dumps({"query": ["b" * 3 * 2**20]}).encode())
    assert status == 413 and "over the limit" in answer["error"]
    assert post(guarded.port, {"query": ["ok"]})[0] == 200


def test_a_slow_client_times_out_with_408(guarded):
    import socket

    body = json.dumps({"query": ["slow"]}).encode()
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=20) as sock:
        sock.sendall(b"POST /get_reward HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        started = time.monotonic()
        for byte in body[:4]:  # a byte every 0.8 s: each arrives within the socket timeout, the whole does not
            sock.sendall(bytes([byte]))
            time.sleep(0.8)
        answer = sock.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 408") and "did not arrive within 2 s" in answer
    assert time.monotonic() - started < 10
    assert post(guarded.port, {"query": ["ok"]})[0] == 200


def test_a_large_request_does_not_starve_small_ones(guarded, reward_dir):
    truth = dict(zip(QUERIES, expected_rewards(reward_dir, QUERIES)))
    big = [QUERIES[i % 4] for i in range(64)]  # 8 forward passes of 8
    with ThreadPoolExecutor(max_workers=2) as pool:
        big_job = pool.submit(post, guarded.port, {"query": big})
        time.sleep(0.05)
        small_started = time.monotonic()
        small = post(guarded.port, {"query": QUERIES[:1]})
        small_done = time.monotonic()
        status, answer = big_job.result()
        big_done = time.monotonic()
    assert small[0] == 200 and small[1]["rewards"] == pytest.approx([truth[QUERIES[0]]], abs=1e-5)
    assert status == 200 and answer["rewards"] == pytest.approx([truth[q] for q in big], abs=1e-5)
    assert small_done < big_done, (small_done - small_started, big_done - small_started)


def test_a_timed_out_request_is_cancelled(reward_dir):
    from rlhfkit.rewards.scorer import load_scorer
    from rlhfkit.rewards.server import RewardServer

    scorer = load_scorer(str(reward_dir), max_len=64, batch_size=1)
    slow_score = scorer.score
    scorer.score = lambda texts: (time.sleep(0.2), slow_score(texts))[1]  # 0.2 s a query: a real, slow model
    with RewardServer(scorer, port=0, batch_wait_ms=0, request_timeout=0.5) as srv:
        status, answer = post(srv.port, {"query": ["x"] * 50})
        assert status == 503 and "timed out" in answer["error"]
        time.sleep(0.5)
        batches = srv.worker.batches_run
        time.sleep(1.0)
        assert srv.worker.batches_run == batches  # the other ~45 queries were dropped, not scored
        assert post(srv.port, {"query": ["ok"]})[0] == 200


def test_the_reward_client_splits_batches_to_fit_the_server(guarded, reward_dir):
    from rlhfkit.rewards.sources import HTTPRewardClient

    truth = dict(zip(QUERIES, expected_rewards(reward_dir, QUERIES)))
    queries = [QUERIES[i % 4] for i in range(150)]  # over the server's 64 queries per request
    client = HTTPRewardClient([guarded.url], max_queries=1024)
    try:
        out = client.score({"queries": queries, "prompts": [""] * 150, "labels": [None] * 150})
    finally:
        client.close()
    assert out["rewards"].tolist() == pytest.approx([truth[q] for q in queries], abs=1e-5)
    assert client.max_queries <= 64


@pytest.mark.parametrize("flags, fragment", [
    (["--port", "70000"], "--port 70000 is not a TCP port"),
    (["--max_queries_per_request", "0"], "--max_queries_per_request must be at least 1"),
    (["--client_timeout", "0"], "--client_timeout must be a positive number"),
])
def test_bad_server_flags_are_user_errors(tmp_path, flags, fragment):
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.preference import ServeRMConfig
    from rlhfkit.errors import UserError

    with pytest.raises(UserError, match=fragment):  # parsing runs ServeRMConfig.validate()
        parse_config(ServeRMConfig, ["--reward_pretrain", "x", *flags], "serve_rm")


def test_bad_port_fails_before_the_model_loads(tmp_path):
    # The model path does not exist either: the port is checked first, before anything loads.
    proc = subprocess.run([sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward_pretrain", str(tmp_path / "none"),
                           "--port", "70000"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "--port 70000 is not a TCP port" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


# -- the server stack: sizes before auth, read timeouts, idle connections, graceful stop, the auth rules ---------
def raw_exchange(port: int, head: bytes, body: bytes = b"", timeout: float = 20) -> str:
    """Send a hand-written request (headers, then maybe part of a body) and return the first answer's text."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head + body)
        return sock.recv(65536).decode(errors="replace")


def head(length: int | str | None, token: str | None = None, extra: str = "") -> bytes:
    lines = ["POST /get_reward HTTP/1.1", "Host: x", "Content-Type: application/json"]
    lines += [f"Content-Length: {length}"] if length is not None else []
    lines += [f"Authorization: Bearer {token}"] if token else []
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode()


@pytest.fixture(scope="module")
def keyed(reward_dir):
    """A server with a token and short timeouts (read, idle) so each case is quick to produce."""
    from rlhfkit.rewards.scorer import load_scorer
    from rlhfkit.rewards.server import RewardServer

    with RewardServer(load_scorer(str(reward_dir), max_len=64, batch_size=8), port=0, api_key="s3cret",
                      client_timeout=1.0, keep_alive_timeout=1.0, max_connections=1000) as srv:
        yield srv


@pytest.mark.parametrize("token", [None, "wrong", "s3cret"])
def test_a_50_mb_declared_body_gets_413_before_auth_and_before_reading(keyed, token):
    started = time.monotonic()
    answer = raw_exchange(keyed.port, head(50 * 2**20, token), b'{"query": ["' + b"x" * 4096)  # 4 KB of 50 MB
    assert answer.startswith("HTTP/1.1 413") and f"body of {50 * 2**20} bytes is over the limit" in answer
    assert time.monotonic() - started < 1.0  # answered from the headers: no wait for the body
    assert post(keyed.port, {"query": ["ok"]}, {"Authorization": "Bearer s3cret"})[0] == 200


@pytest.mark.parametrize("length, body, status, fragment", [
    (None, b"", "411", "Content-Length"),  # (a body sent without a length would parse as a bad next request)
    ("-1", b"", "400", ""),
    ("5", b'{"query": ["a"]}', "400", ""),  # the body runs past its length: the rest is a bad next request
    ("100", b'{"query": ["a"]}', "408", "did not arrive within 1 s"),  # a short body: the read times out
])
def test_bad_or_dishonest_content_length_is_refused(keyed, length, body, status, fragment):
    started = time.monotonic()
    answer = raw_exchange(keyed.port, head(length, "s3cret"), body)
    assert answer.startswith(f"HTTP/1.1 {status}") and fragment in answer, answer
    assert time.monotonic() - started < 5
    assert post(keyed.port, {"query": ["ok"]}, {"Authorization": "Bearer s3cret"})[0] == 200


def test_many_idle_connections_cost_no_threads_and_are_closed(keyed):
    import socket
    import threading

    threads_before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", keyed.port), timeout=10) for _ in range(300)]
    try:
        time.sleep(0.2)
        assert threading.active_count() == threads_before  # one event loop serves them all
        assert post(keyed.port, {"query": ["ok"]}, {"Authorization": "Bearer s3cret"})[0] == 200
        time.sleep(1.5)  # past --keep_alive_timeout 1: the server closed every idle connection
        assert all(sock.recv(1) == b"" for sock in idle)
    finally:
        for sock in idle:
            sock.close()


def test_stop_lets_a_request_in_flight_finish(reward_dir):
    from rlhfkit.rewards.scorer import load_scorer
    from rlhfkit.rewards.server import RewardServer

    scorer = load_scorer(str(reward_dir), max_len=64, batch_size=1)
    score = scorer.score
    scorer.score = lambda texts: (time.sleep(0.1), score(texts))[1]
    srv = RewardServer(scorer, port=0, batch_wait_ms=0).start()
    with ThreadPoolExecutor(max_workers=1) as pool:
        answer = pool.submit(post, srv.port, {"query": ["a"] * 5})
        time.sleep(0.2)
        srv.stop()  # what SIGTERM does in the CLI
        status, body = answer.result(timeout=30)
    assert status == 200 and len(body["rewards"]) == 5
    with pytest.raises(OSError):
        post(srv.port, {"query": ["a"]})


@pytest.mark.parametrize("flags, env, outcome", [
    (["--api_key", ""], "from-env", "from-env"),  # an empty flag (an unset shell variable) keeps the env key
    (["--api_key", "flag"], "from-env", "flag"),
    ([], "from-env", "from-env"),
    (["--no_auth"], None, None),
    ([], None, "serve_rm needs a bearer token: set --api_key or RLHFKIT_RM_API_KEY, or pass --no_auth"),
    (["--api_key", ""], None, "serve_rm needs a bearer token"),
    (["--no_auth"], "from-env", "--no_auth contradicts the key in RLHFKIT_RM_API_KEY"),
    (["--no_auth", "--api_key", "k"], None, "--no_auth contradicts the key in --api_key"),
])
def test_auth_is_off_only_with_no_auth(monkeypatch, flags, env, outcome):
    from rlhfkit.config.base import parse_config
    from rlhfkit.config.preference import ServeRMConfig
    from rlhfkit.errors import UserError

    if env is None:
        monkeypatch.delenv("RLHFKIT_RM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("RLHFKIT_RM_API_KEY", env)
    cfg = parse_config(ServeRMConfig, ["--reward_pretrain", "m", *flags], "serve_rm")
    if outcome is None or " " not in outcome:
        assert cfg.resolved_api_key() == outcome
    else:
        with pytest.raises(UserError, match=outcome):
            cfg.check_inputs()


def test_cli_no_auth_warns_and_serves_without_a_token(reward_dir):
    from rlhfkit.distributed.launch import free_port

    port = free_port()
    env = {k: v for k, v in __import__("os").environ.items() if k != "RLHFKIT_RM_API_KEY"}
    proc = subprocess.Popen([sys.executable, "-m", "rlhfkit.cli.serve_rm", "--reward_pretrain", str(reward_dir),
                             "--port", str(port), "--max_len", "64", "--no_auth"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines, deadline = [], time.monotonic() + 120
        while not any("ready" in line for line in lines) and time.monotonic() < deadline and proc.poll() is None:
            lines.append(proc.stdout.readline())
        assert any("warning: --no_auth: serving without a bearer token" in line for line in lines), lines
        assert post(port, {"query": ["a"]})[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_connections_past_max_connections_get_503(reward_dir):
    import socket

    from rlhfkit.rewards.scorer import load_scorer
    from rlhfkit.rewards.server import RewardServer

    with RewardServer(load_scorer(str(reward_dir), max_len=64), port=0, max_connections=4) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(4)]
        try:
            time.sleep(0.2)
            answer = raw_exchange(srv.port, head(len(b'{"query": ["a"]}')), b'{"query": ["a"]}')
            assert answer.startswith("HTTP/1.1 503")  # uvicorn's own answer (text/plain), before the app runs
        finally:
            for sock in idle:
                sock.close()
        time.sleep(0.2)
        assert post(srv.port, {"query": ["a"]})[0] == 200
