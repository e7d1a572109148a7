"""An HTTP server for a trained reward model: `POST /get_reward {"query": [text, ...]}` -> `{"rewards": [...]}`.

The protocol is OpenRLHF's remote reward model (`--remote_rm_url http://host:port/get_reward`); extra request keys
(`prompts`, `labels`) are accepted and ignored. The stack is FastAPI on uvicorn (one asyncio event loop: an idle
or slow connection costs a little memory, never a thread) in front of ONE scoring thread
(rlhfkit/rewards/batching.py) that fills each forward pass round-robin from every waiting request, so a request
with thousands of queries is scored in chunks that interleave with small ones.

Order of checks on `POST /get_reward`, each before any byte of the body is read: a Content-Length must be given
(411; chunked bodies too) and valid (400), at most --max_body_bytes (413, with or without a token: a refused body
is never read into memory: uvicorn's parser drops its bytes as they come, so a client that sends it anyway
still reads the answer), then the bearer token (401). Only then is the body read, by at most
--max_concurrent_bodies requests at a time, within --client_timeout (408 for a short or slow body). Then the JSON
is validated against `RewardRequest` (400: bad JSON, lone surrogates, nesting too deep, wrong types), the query
count against --max_queries_per_request (413), and the queries wait at most --request_timeout for their scores
(503, and the unscored rest is dropped). Errors are JSON `{"error": ...}`; a bad request never stops the server.

Connections: at most --max_connections at once (more get 503 from uvicorn), an idle one is closed after
--keep_alive_timeout. `stop()` (SIGTERM in the CLI) is graceful: the listener closes, requests in flight get their
answers, then the scoring thread stops.

Scoring a text: see rlhfkit/rewards/scorer.py (`RewardScorer`, `load_scorer`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rlhfkit.config.preference import SERVE_RM_KEY_ENV
from rlhfkit.config.serving import authorized, key_or_env
from rlhfkit.errors import UserError
from rlhfkit.rewards.batching import BatchingWorker, Job
from rlhfkit.rewards.scorer import RewardScorer

API_KEY_ENV = SERVE_RM_KEY_ENV
REWARD_PATH = "/get_reward"
HEALTH_PATH = "/health"


class RewardRequest(BaseModel):
    """OpenRLHF's remote reward model request; `prompts`, `labels` and other keys are accepted and ignored."""

    model_config = ConfigDict(extra="allow")
    query: list[StrictStr] = Field(min_length=1)


class RewardResponse(BaseModel):
    rewards: list[float]


@dataclass(frozen=True)
class Limits:
    """What one client may cost the server (the CLI's flags of the same names)."""

    max_body_bytes: int = 10 * 2**20
    max_queries_per_request: int = 4096
    request_timeout: float = 300.0
    client_timeout: float = 30.0
    max_concurrent_bodies: int = 4
    max_connections: int = 512
    keep_alive_timeout: float = 5.0

    def check(self) -> None:
        if min(self.max_body_bytes, self.max_queries_per_request, self.max_concurrent_bodies,
               self.max_connections) < 1 or min(self.request_timeout, self.client_timeout,
                                                 self.keep_alive_timeout) <= 0:
            raise ValueError(f"every server limit must be positive: {self}")


class Refusal(Exception):
    """An answer other than 200: its status, its one-line reason, and headers (e.g. Connection: close)."""

    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None):
        super().__init__(reason)
        self.status, self.reason, self.headers = status, reason, headers or {}


def _error(status: int, reason: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": reason}, status_code=status, headers=headers)


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
    try:
        texts = RewardRequest.model_validate(payload).query
    except ValidationError as e:
        first = e.errors()[0]
        where = "".join(f"[{p}]" for p in first["loc"][1:])
        return [], f'"query" must be a non-empty list of strings ("query"{where}: {first["msg"]})'
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800") is valid JSON but no text
            return [], f'"query"[{i}] holds a lone UTF-16 surrogate; send valid Unicode text'
    return texts, None


def declared_length(headers: Any, max_body_bytes: int) -> int:
    """The body's Content-Length, checked before any of it is read (411, 400, 413)."""
    if "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" not in headers:
        raise Refusal(411, "send the JSON body with a Content-Length header", {"Connection": "close"})
    raw = headers["content-length"]
    if not raw.isdigit():  # uvicorn's parser refuses most bad values first; "-1" or "1e3" must not pass either
        raise Refusal(400, f"bad Content-Length {raw[:40]!r}", {"Connection": "close"})
    length = int(raw)
    if length > max_body_bytes:  # no Connection: close, so uvicorn reads and drops the body: the client gets this
        raise Refusal(413, f"body of {length} bytes is over the limit of {max_body_bytes}")
    return length


async def read_body(request: Request, length: int, timeout: float) -> bytes:
    """Exactly `length` bytes within `timeout` seconds in all (408: a slow or short body cannot hold a slot)."""
    body = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            body.extend(chunk)
            if len(body) > length:
                raise Refusal(400, f"body runs past its Content-Length of {length}", {"Connection": "close"})

    try:
        await asyncio.wait_for(read(), timeout)
    except asyncio.TimeoutError:
        raise Refusal(408, f"the request body did not arrive within {timeout:g} s",
                       {"Connection": "close"}) from None
    except ClientDisconnect:
        raise Refusal(400, "the client closed the connection before its body arrived") from None
    if len(body) != length:
        raise Refusal(400, f"body of {len(body)} bytes is shorter than its Content-Length of {length}",
                       {"Connection": "close"})
    return bytes(body)


async def wait_for_scores(worker: BatchingWorker, texts: list[str], timeout: float) -> list[float]:
    """Hand the queries to the scoring thread and wait (without a thread) for all of them (503 on failure)."""
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[None] = loop.create_future()

    def settle() -> None:  # on the event loop
        if not answered.done():
            answered.set_result(None)

    def wake() -> None:  # on the scoring thread
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is gone (shutdown): nobody waits any more
            pass

    job = Job(texts, on_done=wake)
    worker.submit(job)
    try:
        await asyncio.wait_for(asyncio.shield(answered), timeout)
    except asyncio.TimeoutError:
        job.cancelled = True  # the worker drops what it has not scored yet
        raise Refusal(503, f"scoring timed out after {timeout:g} s") from None
    if job.error is not None:
        raise Refusal(503, f"scoring failed: {job.error}")
    return job.rewards


def build_app(worker: BatchingWorker, limits: Limits, api_key: str | None) -> FastAPI:
    """The ASGI app: `POST /get_reward`, `GET /health`; JSON errors everywhere."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    body_slots = asyncio.Semaphore(limits.max_concurrent_bodies)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}; "
                                       f"POST {REWARD_PATH} or GET {HEALTH_PATH}")

    @app.exception_handler(Refusal)
    async def refused(request: Request, exc: Refusal) -> JSONResponse:
        return _error(exc.status, exc.reason, exc.headers)

    @app.get(HEALTH_PATH)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post(REWARD_PATH, response_model=RewardResponse)
    async def get_reward(request: Request) -> RewardResponse:
        length = declared_length(request.headers, limits.max_body_bytes)
        if not authorized(request.headers.get("authorization"), api_key):
            raise Refusal(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
        async with body_slots:  # bounds the bodies held in memory at once, whatever the number of connections
            texts, problem = parse_request(await read_body(request, length, limits.client_timeout))
        if problem:
            raise Refusal(400, problem)
        if len(texts) > limits.max_queries_per_request:
            raise Refusal(413, f"{len(texts)} queries in one request is over the limit of "
                                f"{limits.max_queries_per_request}; split the batch")
        return RewardResponse(rewards=await wait_for_scores(worker, texts, limits.request_timeout))

    return app


def resolve_api_key(api_key: str | None) -> str | None:
    """The key: `api_key` when non-empty, else env RLHFKIT_RM_API_KEY (an empty flag never switches auth off)."""
    return key_or_env(api_key, API_KEY_ENV)


def _listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


try:  # the protocol uvicorn's "auto" would pick: httptools when installed (with vLLM), else h11
    import httptools  # noqa: F401
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _BaseProtocol
except ImportError:  # pragma: no cover - depends on the install
    from uvicorn.protocols.http.h11_impl import H11Protocol as _BaseProtocol  # type: ignore[assignment]


class _IdleClosingProtocol(_BaseProtocol):
    """uvicorn arms its keep-alive timer only after a response, so a connection that never sends a request would
    stay open for good (and count against --max_connections). Arm it on connect too: any byte received cancels it."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)


class RewardServer:
    """The reward server in-process: `RewardServer(scorer, port=0).start()`, `.url`, `.stop()` (or `with`).

    `api_key`: None or "" reads env RLHFKIT_RM_API_KEY; with neither, requests need no token (the CLI refuses that
    unless --no_auth is given).
    """

    def __init__(self, scorer: RewardScorer, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 batch_size: int | None = None, batch_wait_ms: float = 5.0, verbose: bool = False, **limits: Any):
        self.limits = Limits(**limits)
        self.limits.check()
        self.scorer = scorer
        self.host = host
        self.port = port
        self.api_key = resolve_api_key(api_key)
        self.verbose = verbose
        self.worker = BatchingWorker(scorer, batch_size or scorer.batch_size, max(batch_wait_ms, 0.0) / 1000)
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}{REWARD_PATH}"

    def start(self) -> RewardServer:
        sock = _listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.worker, self.limits, self.api_key), http=_IdleClosingProtocol,
                                lifespan="off", log_config=None, log_level="info" if self.verbose else "warning",
                                access_log=self.verbose, limit_concurrency=self.limits.max_connections,
                                timeout_keep_alive=int(max(1, round(self.limits.keep_alive_timeout))),
                                timeout_graceful_shutdown=int(max(1, round(self.limits.request_timeout))))
        self._uvicorn = uvicorn.Server(config)
        self.worker.thread.start()
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [sock]}, name="reward-http",
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._uvicorn.started:
            self.stop()
            raise RuntimeError("the reward server's HTTP loop did not start")
        return self

    def stop(self) -> None:
        """Graceful: stop accepting, let requests in flight get their answers, then stop the scoring thread."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=self.limits.request_timeout + 10)
            self._thread = None
        self._uvicorn = None
        self.worker.stop()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
