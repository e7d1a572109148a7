"""Reward sources: a reward-function file (outputs and every way it can go wrong) and HTTP reward servers."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhfkit.errors import UserError
from rlhfkit.rewards.sources import HTTPRewardClient, RewardFunction, make_remote_reward, parse_reward_output

BATCH = {"queries": ["p1 a", "p1 bb", "p2 ccc", "p2 dddd"], "prompts": ["p1 ", "p1 ", "p2 ", "p2 "],
         "labels": ["a", "x", "ccc", "y"]}


def reward_file(tmp_path, body: str, name: str = "reward.py"):
    path = tmp_path / name
    # torch only where the body uses it: each reward function runs in a fresh worker process, which imports it
    path.write_text(("import torch\n\n" if "torch." in body else "") + body)
    return str(path)


def test_list_output_and_labels_reach_the_function(tmp_path):
    path = reward_file(tmp_path, "def reward_func(queries, prompts, labels):\n"
                                 "    return [float(q[len(p):] == l) for q, p, l in zip(queries, prompts, labels)]\n")
    out = RewardFunction(path).score(BATCH)
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out["scores"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out["extra_logs"] == {}


def test_image_references_reach_a_function_that_takes_images_and_only_it(tmp_path):
    """Image prompts: `images=` (each sample's references) for a reward_func with that keyword or **kwargs; an
    OpenRLHF-style (queries, prompts, labels) function is called as before."""
    batch = {**BATCH, "image_refs": [["/a.png"], [], ["/b.png", "/c.png"], ["/d.png"]]}
    for signature, images in (("images=None", "images"), ("**kwargs", "kwargs['images']")):
        path = reward_file(tmp_path, f"def reward_func(queries, prompts, labels, {signature}):\n"
                                     f"    return [float(len(refs)) for refs in {images}]\n")
        assert RewardFunction(path, call_size=3).score(batch)["rewards"].tolist() == [1.0, 0.0, 2.0, 1.0]
    path = reward_file(tmp_path, "def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n")
    assert RewardFunction(path).score(batch)["rewards"].tolist() == [1.0] * 4


def test_dict_output_with_scores_and_extra_logs(tmp_path):
    path = reward_file(tmp_path, "def reward_func(queries, prompts, labels):\n"
                                 "    r = torch.tensor([len(q) for q in queries], dtype=torch.float32)\n"
                                 "    return {'rewards': r, 'scores': r / 10, 'extra_logs': {'len': r, 'one': 1}}\n")
    out = RewardFunction(path).score(BATCH)
    assert out["rewards"].tolist() == [4.0, 5.0, 6.0, 7.0]
    torch.testing.assert_close(out["scores"], torch.tensor([0.4, 0.5, 0.6, 0.7]))
    assert out["extra_logs"] == pytest.approx({"len": 5.5, "one": 1.0})


@pytest.mark.parametrize("body, message", [
    ("def reward_func(queries, prompts, labels):\n    raise ValueError('boom')\n",
     "reward_func raised ValueError: boom"),
    ("def reward_func(queries, prompts, labels):\n    return [1.0] * (len(queries) + 2)\n",
     "returned 3 rewards for 1 query"),  # retried in halves: the error of one sample alone
    ("def reward_func(queries, prompts, labels):\n    return torch.tensor([1.0, float('nan'), 0.0, 0.0])\n",
     "rewards nan for query 1 is not a finite number"),
    ("def reward_func(queries, prompts, labels):\n    return {'rewards': [1, 1, 1, float('inf')]}\n",
     "for query 3 is not a finite number"),
    ("def reward_func(queries, prompts, labels):\n    return {'scores': [1, 1, 1, 1]}\n",
     "has no 'rewards'"),
    ("def reward_func(queries, prompts, labels):\n    return ['a', 'b', 'c', 'd']\n",
     "rewards must be numbers"),
    ("def reward_func(queries, prompts, labels):\n    return None\n",
     "returned None"),
    ("def other(queries, prompts, labels):\n    return []\n",
     "defines no function reward_func"),
    ("import not_a_module_anywhere\n", "importing it failed (ModuleNotFoundError"),
])
def test_broken_reward_function_is_a_user_error_naming_the_file(tmp_path, body, message):
    path = reward_file(tmp_path, body)
    with pytest.raises(UserError) as err:
        RewardFunction(path).score(BATCH)
    text = str(err.value)
    assert path in text and message in text
    assert "\n" not in text


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        make_remote_reward([str(tmp_path / "nope.py")])


def test_parse_reward_output_accepts_numpy_and_lists():
    import numpy as np

    out = parse_reward_output(np.array([1, 0], dtype=np.int64), 2, "here")
    assert out["rewards"].dtype == torch.float32 and out["rewards"].tolist() == [1.0, 0.0]


# -- HTTP ---------------------------------------------------------------------------------------------------
class _Server:
    """A stdlib reward server on 127.0.0.1:0: reward = length of each query + offset; records what it got."""

    def __init__(self, offset: float, fail_first: int = 0, api_key: str | None = None):
        self.offset = offset
        self.fail_first = fail_first
        self.api_key = api_key
        self.received: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the stdlib's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.received.append(body)
                if owner.api_key and self.headers.get("Authorization") != f"Bearer {owner.api_key}":
                    data = json.dumps({"error": "missing or wrong API key"}).encode()
                    self.send_response(401)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if owner.fail_first > 0:
                    owner.fail_first -= 1
                    self.send_response(503)
                    self.end_headers()
                    return
                data = json.dumps({"rewards": [len(q) + owner.offset for q in body["query"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    made = [_Server(0.0), _Server(100.0)]
    yield made
    for s in made:
        s.close()


def test_batch_is_split_over_two_servers_in_order(servers):
    client = make_remote_reward([s.url for s in servers], timeout=5, retries=1)
    assert isinstance(client, HTTPRewardClient)
    batch = {"queries": ["a", "bb", "ccc", "dddd", "eeeee"], "prompts": ["p"] * 5, "labels": [1, 2, 3, 4, 5]}
    out = client.score(batch)
    client.close()
    first, second = servers[0].received, servers[1].received
    assert len(first) == 1 and len(second) == 1
    assert first[0]["query"] + second[0]["query"] == batch["queries"]
    assert abs(len(first[0]["query"]) - len(second[0]["query"])) <= 1
    assert first[0]["labels"] + second[0]["labels"] == [1, 2, 3, 4, 5]
    assert first[0]["prompts"] == ["p"] * len(first[0]["query"])
    n = len(first[0]["query"])
    expected = [len(q) + (0.0 if i < n else 100.0) for i, q in enumerate(batch["queries"])]
    assert out["rewards"].tolist() == expected


def test_image_references_go_to_the_servers_split_like_the_queries(servers):
    client = make_remote_reward([s.url for s in servers], timeout=5, retries=1)
    refs = [["/a.png"], [], ["/b.png", "/c.png"]]
    client.score({"queries": ["a", "bb", "ccc"], "prompts": ["p"] * 3, "labels": [None] * 3, "image_refs": refs})
    client.close()
    first, second = servers[0].received[0], servers[1].received[0]
    assert first["images"] + second["images"] == refs and len(first["images"]) == len(first["query"])
    text_only = make_remote_reward([servers[0].url], timeout=5, retries=1)
    text_only.score({"queries": ["a"], "prompts": ["p"], "labels": [None]})
    text_only.close()
    assert "images" not in servers[0].received[-1]  # a text run's payload is OpenRLHF's, unchanged


def test_server_errors_are_retried():
    server = _Server(0.0, fail_first=2)
    try:
        client = HTTPRewardClient([server.url], timeout=5, retries=3, backoff=0.01)
        assert client.score({"queries": ["xy"], "prompts": [""], "labels": [None]})["rewards"].tolist() == [2.0]
        assert len(server.received) == 3
    finally:
        server.close()


def test_unreachable_server_stops_after_bounded_retries_naming_its_url():
    from rlhfkit.distributed.launch import free_port
    from rlhfkit.errors import ComponentFailed

    url = f"http://127.0.0.1:{free_port()}/get_reward"
    client = HTTPRewardClient([url], timeout=1, retries=3, backoff=0.2)
    started = time.monotonic()
    with pytest.raises(ComponentFailed, match=rf"^reward server {url}: no valid answer after 3 attempt\(s\) in .*"
                                              r"Connection refused.*--load_checkpoint"):
        client.score({"queries": ["a"], "prompts": [""], "labels": [None]})
    assert 0.2 + 0.4 <= time.monotonic() - started < 10  # two backoffs (0.2 s, 0.4 s), then it gives up


def test_hung_server_hits_the_request_timeout():
    """A server that accepts connections but never answers (hung, not dead): each attempt ends after the request
    timeout, and the run stops after the last one instead of waiting forever."""
    from rlhfkit.errors import ComponentFailed

    with socket.socket() as hung:  # listens (the kernel completes the handshake) but never reads or answers
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}/get_reward"
        client = HTTPRewardClient([url], timeout=1, retries=2, backoff=0.1)
        started = time.monotonic()
        with pytest.raises(ComponentFailed, match=rf"^reward server {url}: no valid answer after 2 attempt.*timed "
                                                  r"out after --remote_rm_timeout 1 s"):
            client.score({"queries": ["a"], "prompts": [""], "labels": [None]})
        assert 2 * 1 + 0.1 <= time.monotonic() - started < 15
        client.close()


def test_api_key_is_sent_and_a_refusal_is_not_retried(monkeypatch):
    server = _Server(0.0, api_key="sesame")
    try:
        client = HTTPRewardClient([server.url], timeout=5, retries=3, backoff=0.01)
        monkeypatch.delenv("RLHFKIT_RM_API_KEY", raising=False)
        with pytest.raises(UserError, match="after 1 attempt.*HTTP 401: missing or wrong API key"):
            client.score({"queries": ["a"], "prompts": [""], "labels": [None]})
        monkeypatch.setenv("RLHFKIT_RM_API_KEY", "sesame")
        assert client.score({"queries": ["abc"], "prompts": [""], "labels": [None]})["rewards"].tolist() == [3.0]
    finally:
        server.close()


# -- isolation: a failing call costs its samples (rlhfkit.rewards.user_code runs the file in workers) ----------
BAD_BY_LABEL = """
import ctypes, os, time


def reward_func(queries, prompts, labels):
    kind = labels[0]
    if kind == "raise":
        raise ValueError("boom on purpose")
    if kind == "sleep":
        time.sleep(30)
    if kind == "exit":
        os._exit(1)
    if kind == "segfault":
        ctypes.string_at(0)
    if kind == "short":
        return []
    if kind == "nan":
        return [float("nan")] * len(queries)
    return [float(len(q)) for q in queries]
"""
LABELS = ["ok", "raise", "sleep", "nan", "short", "exit", "segfault", "ok"]


def test_bad_crash_and_timeout_calls_cost_their_samples_and_are_counted(tmp_path):
    batch = {"queries": [f"q{i}" + "x" * i for i in range(8)], "prompts": [""] * 8, "labels": LABELS}
    source = RewardFunction(reward_file(tmp_path, BAD_BY_LABEL), workers=2, timeout=1.5, fallback=-1.0,
                            max_failure_ratio=0.8, call_size=1)
    try:
        out = source.score(batch)
        assert out["rewards"].tolist() == [2.0, -1, -1, -1, -1, -1, -1, 9.0]
        assert out["scores"].tolist() == out["rewards"].tolist()
        assert out["metrics"] == {"reward/failures": 6.0, "reward/failure_kinds/exception": 1.0,
                                  "reward/failure_kinds/timeout": 1.0, "reward/failure_kinds/non_finite": 1.0,
                                  "reward/failure_kinds/wrong_length": 1.0, "reward/failure_kinds/crash": 2.0,
                                  "reward/retry_rounds": 0.0, "reward/retry_seconds": 0.0}  # calls of 1 sample
        assert source.pool.replaced == 3  # timeout, exit, segfault
        clean = source.score({**batch, "labels": ["ok"] * 8})  # the pool serves on, with no failure counted
        assert clean["rewards"].tolist() == [float(2 + i) for i in range(8)]
        assert clean["metrics"] == {"reward/failures": 0.0, "reward/retry_rounds": 0.0, "reward/retry_seconds": 0.0}
    finally:
        source.close()


def test_bad_samples_above_the_ratio_stop_with_file_reason_and_sample(tmp_path):
    path = reward_file(tmp_path, BAD_BY_LABEL)
    batch = {"queries": ["first query", "second\nquery", "third", "fourth"], "prompts": [""] * 4,
             "labels": ["ok", "raise", "raise", "ok"]}
    source = RewardFunction(path, workers=1, fallback=0.0, max_failure_ratio=0.25, call_size=1)
    try:
        with pytest.raises(UserError) as err:
            source.score(batch)
    finally:
        source.close()
    text = str(err.value)
    assert text == (f"reward function {path}: reward_func raised ValueError: boom on purpose; 2 of 4 samples failed "
                    "this step (more than --max_reward_failure_ratio 0.25); e.g. query 1: 'second\\nquery'")


def test_bad_nan_costs_only_its_own_sample_in_a_call(tmp_path):
    path = reward_file(tmp_path, "def reward_func(queries, prompts, labels):\n"
                                 "    return {'rewards': [1.0, float('nan'), 0.5, 2.0],\n"
                                 "            'scores': [1.0, 1.0, float('inf'), 1.0]}\n")
    source = RewardFunction(path, fallback=-2.0, max_failure_ratio=0.5)
    try:
        out = source.score(BATCH)
    finally:
        source.close()
    assert out["rewards"].tolist() == [1.0, -2.0, -2.0, 2.0]
    assert out["scores"].tolist() == [1.0, -2.0, -2.0, 1.0]
    assert out["metrics"] == {"reward/failures": 2.0, "reward/failure_kinds/non_finite": 2.0,
                              "reward/retry_rounds": 0.0, "reward/retry_seconds": 0.0}  # no retry for NaN
