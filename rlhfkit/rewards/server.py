"""An HTTP server for a trained reward model: `POST /get_reward {"query": [text, ...]}` -> `{"rewards": [...]}`.

The protocol is OpenRLHF's remote reward model (`--remote_rm_url http://host:port/get_reward`); extra request keys
(`prompts`, `labels`) are accepted and ignored. Standard library only (`http.server.ThreadingHTTPServer`):

- Each request is handled on its own thread, which validates it and hands its queries to ONE batching worker.
  The worker fills each forward pass of up to --batch_size queries round-robin from every waiting request
  (waiting at most --batch_wait_ms for more), so the model is only ever used by one thread and a request with
  thousands of queries shares the model with small ones instead of blocking them until it is done. A request
  that times out is cancelled: the worker drops its queries not yet scored.
- Binds 127.0.0.1 unless told otherwise. With an API key (`--api_key` or env RLHFKIT_RM_API_KEY) every request
  but `GET /health` needs `Authorization: Bearer <key>` (compared in constant time).
- Errors are JSON `{"error": ...}`: 400 bad JSON or types (query must be a non-empty list of strings; lone
  surrogates and too deeply nested JSON included), 401 missing or wrong token, 404 unknown path, 408 a client
  that takes longer than --client_timeout to send its request, 411 no Content-Length, 413 a body over
  --max_body_bytes or more than --max_queries_per_request queries (the body is read and discarded first, up to a
  bound, so the client sees the answer instead of a reset connection), 503 scoring failed or timed out. A bad
  request never stops the server.

Scoring a text: see rlhfkit/rewards/scorer.py (`RewardScorer`, `load_scorer`).
"""

from __future__ import annotations

import hmac
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from rlhfkit.errors import UserError
from rlhfkit.rewards.scorer import RewardScorer

API_KEY_ENV = "RLHFKIT_RM_API_KEY"
REWARD_PATH = "/get_reward"
DRAIN_LIMIT_BYTES = 256 * 2**20  # a refused body bigger than this is not read: the connection is reset instead
HEALTH_PATH = "/health"


@dataclass
class _Job:
    texts: list[str]
    done: threading.Event = field(default_factory=threading.Event)
    rewards: list[float] = field(default_factory=list)
    error: str | None = None
    cancelled: bool = False

    @property
    def pending(self) -> int:
        return len(self.texts) - len(self.rewards)


class _BatchingWorker:
    """One thread that owns the model: it fills batches fairly from the waiting jobs and scores them."""

    def __init__(self, scorer: RewardScorer, batch_size: int, wait_s: float):
        self.scorer = scorer
        self.batch_size = batch_size
        self.wait_s = wait_s
        self.jobs: queue.Queue[_Job] = queue.Queue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="reward-batcher", daemon=True)
        self.batches_run = 0
        self.active: list[_Job] = []  # jobs with queries not yet scored, oldest first (worker thread only)

    def _admit(self, block_s: float) -> None:
        """Move queued jobs into the active list, waiting up to `block_s` for the first one."""
        try:
            self.active.append(self.jobs.get(timeout=block_s) if block_s > 0 else self.jobs.get_nowait())
            while True:
                self.active.append(self.jobs.get_nowait())
        except queue.Empty:
            pass

    def _fill(self) -> list[tuple[_Job, int]]:
        """Round-robin over the active jobs: each contributes its next query in turn until the batch is full."""
        for job in self.active:
            if job.cancelled:
                job.done.set()
        self.active = [j for j in self.active if not j.cancelled]
        taken = {id(j): 0 for j in self.active}
        picks: list[tuple[_Job, int]] = []
        while len(picks) < self.batch_size:
            progressed = False
            for job in self.active:
                if taken[id(job)] < job.pending and len(picks) < self.batch_size:
                    picks.append((job, len(job.rewards) + taken[id(job)]))
                    taken[id(job)] += 1
                    progressed = True
            if not progressed:
                break
        return picks

    def _run(self) -> None:
        while not self.stopping.is_set():
            self._admit(0.1 if not self.active else 0)
            if not self.active:
                continue
            if sum(j.pending for j in self.active) < self.batch_size and self.wait_s > 0:
                deadline = time.monotonic() + self.wait_s  # a short wait lets concurrent requests share the pass
                while sum(j.pending for j in self.active) < self.batch_size and time.monotonic() < deadline:
                    self._admit(deadline - time.monotonic())
            picks = self._fill()
            if not picks:
                continue
            try:
                rewards = self.scorer.score([job.texts[i] for job, i in picks])
            except Exception as e:  # noqa: BLE001 - report to the requests in this batch, keep serving
                for job in {id(j): j for j, _ in picks}.values():
                    job.error = f"{type(e).__name__}: {e}"
                    job.cancelled = True
                    job.done.set()
            else:
                for (job, _), reward in zip(picks, rewards):  # picks of one job are in order
                    job.rewards.append(reward)
            self.batches_run += 1
            for job in self.active:
                if job.pending == 0:
                    job.done.set()
            self.active = [j for j in self.active if j.pending > 0 and not j.cancelled]
        for job in self.active:
            job.error = "server is shutting down"
            job.done.set()
        while not self.jobs.empty():  # fail whatever arrived during shutdown
            job = self.jobs.get_nowait()
            job.error = "server is shutting down"
            job.done.set()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rlhfkit-reward-server"
    timeout = 30  # seconds a client may stay silent while sending its request line and headers

    @property
    def owner(self) -> RewardServer:
        return self.server.owner  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if self.owner.verbose:
            super().log_message(format, *args)

    def _reply(self, code: int, payload: dict[str, Any], close: bool = False,
               headers: dict[str, str] | None = None) -> None:
        body = json.dumps(payload).encode("utf-8")
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        key = self.owner.api_key
        if not key:
            return True
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if urlsplit(self.path).path == HEALTH_PATH:
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": f"unknown path {urlsplit(self.path).path}; POST {REWARD_PATH}"})

    def do_POST(self) -> None:  # noqa: N802
        path = urlsplit(self.path).path
        if path != REWARD_PATH:  # the body is left unread: close the connection after answering
            self._reply(404, {"error": f"unknown path {path}; POST {REWARD_PATH}"}, close=True)
            return
        if not self._authorized():
            self._reply(401, {"error": "missing or wrong bearer token"}, close=True,
                        headers={"WWW-Authenticate": "Bearer"})
            return
        body = self._read_body()
        if body is None:
            return
        texts, problem = parse_request(body)
        if problem:
            self._reply(400, {"error": problem})
            return
        if len(texts) > self.owner.max_queries_per_request:
            self._reply(413, {"error": f"{len(texts)} queries in one request is over the limit of "
                                       f"{self.owner.max_queries_per_request}; split the batch"})
            return
        job = _Job(texts)
        self.owner.worker.jobs.put(job)
        if not job.done.wait(self.owner.request_timeout):
            job.cancelled = True  # the worker drops what it has not scored yet
            self._reply(503, {"error": f"scoring timed out after {self.owner.request_timeout:g} s"})
        elif job.error is not None:
            self._reply(503, {"error": f"scoring failed: {job.error}"})
        else:
            self._reply(200, {"rewards": job.rewards})

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering 411/400/413 (and closing the connection)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower() or "Content-Length" not in self.headers:
            self._reply(411, {"error": "send the JSON body with a Content-Length header"}, close=True)
            return None
        try:
            length = int(self.headers["Content-Length"])
        except ValueError:
            length = -1
        if length < 0:
            self._reply(400, {"error": "bad Content-Length"}, close=True)
            return None
        if length > self.owner.max_body_bytes:
            self._reply(413, {"error": f"body of {length} bytes is over the limit of {self.owner.max_body_bytes}"},
                        close=True)
            self._discard(min(length, DRAIN_LIMIT_BYTES))
            return None
        body = self._read_exactly(length)
        if body is None:
            self._reply(408, {"error": f"the request body did not arrive within {self.owner.client_timeout:g} s"},
                        close=True)
        return body

    def _read_exactly(self, length: int) -> bytes | None:
        """`length` body bytes, or None when the client is slower than --client_timeout in all (slow clients
        cannot hold a thread for long by trickling a byte at a time)."""
        deadline = time.monotonic() + self.owner.client_timeout
        chunks, got = [], 0
        try:
            while got < length:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self.connection.settimeout(remaining)
                chunk = self.rfile.read1(min(length - got, 1 << 20))
                if not chunk:
                    return None
                chunks.append(chunk)
                got += len(chunk)
        except (TimeoutError, OSError):
            return None
        finally:
            self.connection.settimeout(self.timeout)
        return b"".join(chunks)

    def _discard(self, length: int) -> None:
        """Read and drop up to `length` bytes of a refused body so the client reads our answer (closing with
        unread data would reset the connection before it does)."""
        deadline = time.monotonic() + min(self.owner.client_timeout, 10.0)
        try:
            while length > 0 and time.monotonic() < deadline:
                self.connection.settimeout(max(deadline - time.monotonic(), 0.01))
                chunk = self.rfile.read1(min(length, 1 << 20))
                if not chunk:
                    break
                length -= len(chunk)
        except (TimeoutError, OSError):
            pass


def parse_request(body: bytes) -> tuple[list[str], str | None]:
    """(queries, None) for a valid body, else ([], what is wrong)."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return [], f"body is not valid JSON ({e})"
    except RecursionError:
        return [], "body is nested too deeply"
    if not isinstance(payload, dict) or "query" not in payload:
        return [], 'expected a JSON object {"query": [text, ...]}'
    texts = payload["query"]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        return [], '"query" must be a non-empty list of strings'
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800") is valid JSON but no text
            return [], f'"query"[{i}] holds a lone UTF-16 surrogate; send valid Unicode text'
    return texts, None


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default (5) resets bursts of concurrent connections

    def __init__(self, address: tuple[str, int], owner: RewardServer):
        self.owner = owner
        super().__init__(address, _Handler)


class RewardServer:
    """The reward server in-process: `RewardServer(scorer, port=0).start()`, `.url`, `.stop()` (or `with`)."""

    def __init__(self, scorer: RewardScorer, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 batch_size: int | None = None, batch_wait_ms: float = 5.0, max_body_bytes: int = 10 * 2**20,
                 max_queries_per_request: int = 4096, request_timeout: float = 300.0, client_timeout: float = 30.0,
                 verbose: bool = False):
        if max_body_bytes < 1 or max_queries_per_request < 1 or request_timeout <= 0 or client_timeout <= 0:
            raise ValueError("max_body_bytes, max_queries_per_request, request_timeout and client_timeout must be "
                             "positive")
        self.scorer = scorer
        self.host = host
        self.port = port
        self.api_key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
        self.max_body_bytes = max_body_bytes
        self.max_queries_per_request = max_queries_per_request
        self.request_timeout = request_timeout
        self.client_timeout = client_timeout
        self.verbose = verbose
        self.worker = _BatchingWorker(scorer, batch_size or scorer.batch_size, max(batch_wait_ms, 0.0) / 1000)
        self.httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}{REWARD_PATH}"

    def start(self) -> RewardServer:
        try:
            self.httpd = _HTTPServer((self.host, self.port), self)
        except OSError as e:
            raise UserError(f"cannot listen on {self.host}:{self.port}: {e.strerror or e}") from None
        self.port = self.httpd.server_address[1]
        self.worker.thread.start()
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="reward-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
        self.worker.stopping.set()
        if self.worker.thread.is_alive():
            self.worker.thread.join(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
