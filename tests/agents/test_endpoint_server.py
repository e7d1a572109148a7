"""The policy endpoint's server (FastAPI on uvicorn, 127.0.0.1): the official `openai` client drives a two-turn
function-calling episode, streamed and not, whose trace keeps the sampled tokens exactly; bad requests get
OpenAI-shaped errors without touching the trace; the limits hold before a body is read."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from rlhfkit.agents import OpenAIAgentExecutor, Prompt
from rlhfkit.agents import endpoint_server as es
from rlhfkit.rollout.engine import SampledSequence

TEMPLATES = Path(__file__).with_name("tool_templates")
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def tok(demo_assets):
    tokenizer = AutoTokenizer.from_pretrained(demo_assets.model_dir)
    tokenizer.chat_template = (TEMPLATES / "hermes.jinja").read_text()
    return tokenizer


class ScriptedEngine:
    """The engine's interface with scripted turns (the tiny random model would not call a tool): what each call
    was given is kept."""

    def __init__(self, tok, turns: list[str]):
        self.turns = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in turns]
        self.contexts: list[list[int]] = []

    async def generate(self, context, max_new_tokens, sampling_params=None):
        ids = self.turns[len(self.contexts)][:max_new_tokens]
        self.contexts.append(list(context))
        return SampledSequence(list(context), ids, [-0.5] * len(ids), "stop")


class ClientAgent(OpenAIAgentExecutor):
    """The official client, as an agent framework would use it: a tool call, its result, the final answer."""

    def __init__(self, stream: bool):
        super().__init__()
        self.stream, self.seen = stream, {}

    def run_agent(self, base_url: str, prompt: str, label) -> float:
        client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": prompt}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=[ADD], max_tokens=60)
        call = first.choices[0].message.tool_calls[0]
        self.seen["first"] = (first.choices[0].finish_reason, call.function.name, json.loads(call.function.arguments))
        messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        if self.stream:
            chunks = list(client.chat.completions.create(model="policy", messages=messages, tools=[ADD],
                                                         stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            self.seen["second"] = (text, [c.choices[0].finish_reason for c in chunks if c.choices][-1])
        else:
            second = client.chat.completions.create(model="policy", messages=messages, tools=[ADD])
            text = second.choices[0].message.content
            self.seen["second"] = (text, second.choices[0].finish_reason)
        return 1.0 if text.strip() == str(label) else 0.0


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_openai_client_drives_a_function_calling_episode(tok, stream):
    engine = ScriptedEngine(tok, [CALL, "5"])
    agent = ClientAgent(stream).bind(max_steps=3, max_length=200, llm_engine=engine, hf_tokenizer=tok)
    episode = asyncio.run(agent.execute(Prompt("What is 2+3?", [tok.bos_token_id]), "5", dict(SAMPLING)))
    assert agent.seen["first"] == ("tool_calls", "add", {"a": 2, "b": 3})
    assert agent.seen["second"] == ("5", "stop")
    assert episode.finish == "done" and episode.reward == 1.0 and episode.turns == 2
    first, second = engine.turns
    tool_turn = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    feedback = tok.encode(tool_turn, add_special_tokens=False)
    # token in, token out: the sampled ids as sampled, the tool result tokenised once between them
    assert episode.response_ids == first + feedback + second
    assert episode.action_mask == [1] * len(first) + [0] * len(feedback) + [1] * len(second)
    assert engine.contexts[1] == episode.prompt_ids + first + feedback


def _episode(tok, turns=("hello",), max_length=60):
    from rlhfkit.agents.openai_endpoint import EpisodeEndpoint, Trace

    trace = Trace(tok, max_length, max_turns=2)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    endpoint = EpisodeEndpoint(trace, ScriptedEngine(tok, list(turns)), dict(SAMPLING), loop)
    url, key = es.server().register(endpoint)
    return url, key, trace


def _post(url: str, payload: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.mark.parametrize("payload, needle", [
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": float("inf")}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 12}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 0.3}, "temperature=0.3 differs"),
])
def test_bad_requests_get_one_line_and_leave_the_trace_alone(tok, payload, needle):
    url, key, trace = _episode(tok)
    try:
        status, body = _post(f"{url}/chat/completions", payload)
        assert status == 400 and needle in body["error"]["message"], body
        assert trace.episode is None and trace.history is None  # nothing recorded for a refused call
        status, body = _post(f"{url}/chat/completions", {"messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "tool", "content": "x", "tool_call_id": "1"}]})
        assert status == 200 and body["choices"][0]["message"]["content"] == "hello"  # every role, content parts
    finally:
        es.server().unregister(key)


def _raw(head: str, body: bytes = b"", wait: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", es.server().port), timeout=wait) as s:
        s.sendall(head.encode() + body)
        chunks = []
        try:
            while data := s.recv(65536):
                chunks.append(data)
        except TimeoutError:
            pass
        return b"".join(chunks)


def test_limits_hold_before_a_body_is_read(tok, monkeypatch):
    url, key, _ = _episode(tok)
    path = url.split("127.0.0.1:", 1)[1].split("/", 1)[1]
    try:
        big = f"POST /{path}/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
              f"Content-Length: {50 * 1024 * 1024}\r\n\r\n"
        assert b" 413 " in _raw(big).split(b"\r\n")[0]  # 50 MB declared, none sent: refused at once
        assert b" 413 " in _raw(big.replace("Host: x", "Host: x\r\nAuthorization: Bearer -")).split(b"\r\n")[0]
        assert b" 411 " in _raw(f"POST /{path}/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n").split(b"\r\n")[0]
        assert b" 400 " in _raw(f"POST /{path}/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n"
                                ).split(b"\r\n")[0]  # serve_rm's checks: a bad length is refused, not read
        assert b" 404 " in _raw("GET /episodes/0000/v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                                ).split(b"\r\n")[0]
        monkeypatch.setattr(es, "READ_TIMEOUT_S", 1.0)
        started = time.monotonic()
        _raw(f"POST /{path}/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n", b"{\"mess")
        assert time.monotonic() - started < 8  # a body that stops short is dropped after the read timeout
        threads = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", es.server().port)) for _ in range(300)]
        try:
            status, _ = _post(f"{url}/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
            assert status == 200 and threading.active_count() <= threads + 2  # idle connections cost no threads
        finally:
            for s in idle:
                s.close()
    finally:
        es.server().unregister(key)
