"""The agents' policy endpoint (rlhfkit/agents/endpoint_server.py) under idle connections and concurrent episodes.

In one process, as in a rollout engine: the endpoint server, an engine stand-in that answers each call after a fixed
delay (so the figures measure the server, not a model), and
1. 1,000 idle TCP connections held open: the process's threads and RSS before and after, and the latency of a
   request while they are open;
2. 64 episodes driven at once by the official `openai` client (two chat turns each): wall time and p50/p99 latency;
3. fairness (issue 25 acceptance 4): 19 clients x 200 small one-turn requests alone, then beside a 20th client
   sending 1 MB requests (a million-token prompt for the stand-in tokenizer, within its 1.1M-token context) the whole
   time: the small requests' p99 beside it over their p99 alone (target < 2x); then the same beside 4 MB requests,
   past the context (refused with a 400 before the engine, the trace or the reply see them);
4. 50 MB bodies, to a served episode's URL and to an unknown key: 413 before the body is read.
Writes bench/results/endpoint_load.md. Run: `.venv/bin/python bench/endpoint_load.py` (about a minute).
"""

from __future__ import annotations

import asyncio
import os
import platform
import resource
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).with_name("results") / "endpoint_load.md"
DELAY_S = 0.02  # the stand-in engine's time per call
BIG_CHARS = 1024 * 1024  # the big client's message: 1 MB, a million tokens for the stand-in tokenizer


class Tokenizer:
    """Just enough of a tokenizer: one id per character, a chat template of role-prefixed lines."""

    eos_token, eos_token_id, bos_token_id, chat_template = "$", 36, None, ""
    model_max_length = 1_100_000  # a long-context model: 1 MB prompts fit, 4 MB ones are refused before the engine

    def encode(self, text, add_special_tokens=False):
        # In C, like a run's (Rust) tokenizer: a pure-Python loop here would hold the GIL for seconds per big request
        # and measure the stand-in instead of the server
        return (np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32) % 1000).tolist()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) if i != 36 else ("" if skip_special_tokens else "$") for i in ids)

    def convert_ids_to_tokens(self, i):
        return chr(i)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **_):
        text = "".join(f"{m['role']}: {m['content']}$" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")


class Engine:
    async def generate(self, context, max_new_tokens, sampling_params=None):
        from rlhfkit.rollout.engine import SampledSequence

        await asyncio.sleep(DELAY_S)
        ids = [ord(c) for c in "ok"][:max_new_tokens] + [36]
        return SampledSequence(list(context), ids, [-0.1] * len(ids), "stop")


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def episode(loop, turns: int = 2) -> list[float]:
    import openai

    from rlhfkit.agents import endpoint_server as es
    from rlhfkit.agents.openai_endpoint import EpisodeEndpoint, Trace

    endpoint = EpisodeEndpoint(Trace(Tokenizer(), 10_000, max_turns=turns), Engine(), {}, loop)
    url, key = es.server().register(endpoint)
    client = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=60)
    messages: list = [{"role": "user", "content": "hi"}]
    times = []
    try:
        for _ in range(turns):
            started = time.perf_counter()
            reply = client.chat.completions.create(model="policy", messages=messages)
            times.append(time.perf_counter() - started)
            messages += [reply.choices[0].message, {"role": "user", "content": "more"}]
    finally:
        es.server().unregister(key)
    return times


def small_requests(loop, count: int) -> list[float]:
    """`count` one-turn episodes, one request each (raw HTTP, so the client costs little): their latencies."""
    import httpx

    from rlhfkit.agents import endpoint_server as es
    from rlhfkit.agents.openai_endpoint import EpisodeEndpoint, Trace

    times = []
    with httpx.Client(timeout=120) as http:
        for _ in range(count):
            url, key = es.server().register(EpisodeEndpoint(Trace(Tokenizer(), 100), Engine(), {}, loop))
            started = time.perf_counter()
            reply = http.post(f"{url}/chat/completions", json={"model": "policy", "messages": [
                {"role": "user", "content": "hi"}]})
            times.append(time.perf_counter() - started)
            es.server().unregister(key)
            assert reply.status_code == 200, reply.text
    return times


def big_requests(loop, stop: threading.Event, chars: int) -> tuple[int, int]:
    """Prompts of `chars` characters until `stop`: (served, refused with a 400)."""
    import httpx

    from rlhfkit.agents import endpoint_server as es
    from rlhfkit.agents.openai_endpoint import EpisodeEndpoint, Trace

    content, served, refused = "x" * chars, 0, 0
    with httpx.Client(timeout=300) as http:
        while not stop.is_set():
            url, key = es.server().register(EpisodeEndpoint(Trace(Tokenizer(), 100), Engine(), {}, loop))
            reply = http.post(f"{url}/chat/completions", json={"model": "policy", "messages": [
                {"role": "user", "content": content}]})
            es.server().unregister(key)
            served += reply.status_code == 200
            refused += reply.status_code == 400
    return served, refused


def p99(times: list[float]) -> float:
    return sorted(times)[int(0.99 * (len(times) - 1))]


def fairness(loop, chars: int) -> tuple[float, float, tuple[int, int]]:
    """(p99 of the small requests alone, p99 beside a client sending `chars`-character prompts, (its requests
    served, refused))."""
    with ThreadPoolExecutor(19) as pool:
        alone = [t for times in pool.map(lambda _: small_requests(loop, 200), range(19)) for t in times]
    stop = threading.Event()
    with ThreadPoolExecutor(20) as pool:
        big = pool.submit(big_requests, loop, stop, chars)
        time.sleep(0.5)
        beside = [t for times in pool.map(lambda _: small_requests(loop, 200), range(19)) for t in times]
        stop.set()
        return p99(alone), p99(beside), big.result()


def fifty_mb(port: int, key: str) -> list[str]:
    """The status lines of a 50 MB body sent to a served episode and to an unknown key, and how long each took."""
    answers = []
    for path in (f"/episodes/{key}/v1/chat/completions", "/episodes/0000/v1/chat/completions"):
        started = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {50 * 1024 * 1024}\r\n\r\n".encode() + b"{" * 65536)
            status = s.recv(4096).split(b"\r\n", 1)[0].decode()
        answers.append(f"{status} ({time.perf_counter() - started:.2f} s)")
    return answers


def main() -> None:
    from rlhfkit.agents import endpoint_server as es

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    episode(loop)  # start the server, warm the imports
    before = (threading.active_count(), rss_mib())
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    idle = [socket.create_connection(("127.0.0.1", es.server().port)) for _ in range(1000)]
    time.sleep(1.0)
    during = (threading.active_count(), rss_mib())
    probe = episode(loop)
    for s in idle:
        s.close()
    started = time.perf_counter()
    with ThreadPoolExecutor(64) as pool:
        latencies = [t for times in pool.map(lambda _: episode(loop), range(64)) for t in times]
    wall = time.perf_counter() - started
    latencies.sort()
    alone, beside, (served, _) = fairness(loop, BIG_CHARS)
    alone4, beside4, (_, refused4) = fairness(loop, 4 * BIG_CHARS)
    from rlhfkit.agents.openai_endpoint import EpisodeEndpoint, Trace

    url, key = es.server().register(EpisodeEndpoint(Trace(Tokenizer(), 100), Engine(), {}, loop))
    too_big = fifty_mb(es.server().port, key)
    load = os.getloadavg()
    lines = [
        f"## {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; load average "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}. Engine stand-in: {DELAY_S * 1000:.0f} ms per call.",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| threads before / with 1,000 idle connections | {before[0]} / {during[0]} |",
        f"| RSS before / with 1,000 idle connections | {before[1]:.0f} MiB / {during[1]:.0f} MiB |",
        f"| a two-turn episode while they are open | {sum(probe) * 1000:.0f} ms |",
        f"| 64 concurrent two-turn episodes (openai client) | {wall:.2f} s wall |",
        f"| their per-call latency p50 / p99 | {statistics.median(latencies) * 1000:.0f} / "
        f"{p99(latencies) * 1000:.0f} ms |",
        f"| 19 clients x 200 small requests alone: p99 | {alone * 1000:.0f} ms |",
        f"| the same beside a 20th client sending 1 MB requests: p99 | {beside * 1000:.0f} ms: "
        f"{beside / alone:.2f}x alone (target < 2x); {served} big requests served meanwhile |",
        f"| the same alone, then beside a client sending 4 MB requests (over the context): p99 | "
        f"{alone4 * 1000:.0f} ms, then {beside4 * 1000:.0f} ms: {beside4 / alone4:.2f}x; {refused4} refused (400) |",
        f"| a 50 MB body to a served episode / to an unknown key | {too_big[0]} / {too_big[1]} |",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    header = "# Policy endpoint under load\n\nScript: `bench/endpoint_load.py`. Each section is one run.\n\n"
    old = RESULTS.read_text() if RESULTS.exists() else header
    RESULTS.write_text(old + text + "\n")


if __name__ == "__main__":
    main()
