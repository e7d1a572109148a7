"""The HTTP server behind the policy endpoint: one FastAPI app on uvicorn per process, on 127.0.0.1, serving every
episode of that process (rlhfkit/agents/openai_endpoint.py holds what an episode does with a request).

Each episode is reached at its own base URL, `http://127.0.0.1:PORT/episodes/<key>/v1`, where the key is 128 random
bits: the URL is the episode's credential (a request for an unknown key gets 404), so no other client on the machine
can write into an episode's token trace, and an agent's client needs nothing but the base URL (the `openai`
client's api_key is ignored).

Limits, checked before a body is read (serve_rm's `declared_length`): a POST needs a Content-Length (411), a valid
one (400), of at most `MAX_BODY_BYTES` (413, with or without a key); the body must arrive within `READ_TIMEOUT_S`
(else the connection is dropped); at most `MAX_REQUESTS` requests are served at once (the rest wait), at most
`MAX_CONNECTIONS` connections are open (503 beyond; an idle connection costs no thread), an idle keep-alive
connection is closed after `KEEP_ALIVE_S`. Validation errors are OpenAI-shaped 400s naming the field. The server
stops with its process (a daemon thread) or `stop()`.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.datastructures import Headers

# At module level: FastAPI resolves the routes' (string) annotations in this module's globals.
from rlhfkit.agents.openai_schema import ChatRequest, CompletionRequest
from rlhfkit.rewards.server import Refusal, declared_length

MAX_BODY_BYTES = 8 * 1024 * 1024
READ_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 4096  # open connections, idle ones included (uvicorn's limit_concurrency: 503 beyond)
MAX_REQUESTS = 64  # requests served at once; more wait their turn (each holds a worker thread while it generates)
KEEP_ALIVE_S = 5

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def _error(status: int, message: str, kind: str = "invalid_request_error") -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": kind}}


class BodyLimits:
    """ASGI middleware: Content-Length required and bounded before anything reads the body; the body read with a
    timeout."""

    def __init__(self, app: Any):
        self.app = app
        self.slots: asyncio.Semaphore | None = None  # created in the server's event loop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        try:  # the same checks as serve_rm's: 411 without a length (or chunked), 400 for a bad one, 413 past the limit
            declared_length(Headers(scope=scope), MAX_BODY_BYTES)
        except Refusal as refusal:
            return await _send_json(send, *_error(refusal.status, refusal.reason))

        async def timed_receive() -> MutableMapping[str, Any]:
            try:
                return await asyncio.wait_for(receive(), READ_TIMEOUT_S)
            except asyncio.TimeoutError:
                return {"type": "http.disconnect"}

        if self.slots is None:
            self.slots = asyncio.Semaphore(MAX_REQUESTS)
        async with self.slots:
            return await self.app(scope, timed_receive, send)


async def _send_json(send: Send, status: int, payload: dict) -> None:
    import json

    data = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


class EndpointServer:
    """The process's server (`server()`); episodes `register` a handler object and get their base URL."""

    def __init__(self) -> None:
        import uvicorn

        self.episodes: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(BodyLimits(build_app(self)), log_level="warning", limit_concurrency=MAX_CONNECTIONS,
                                timeout_keep_alive=KEEP_ALIVE_S, lifespan="off", access_log=False)
        self.uvicorn = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="rlhfkit-endpoint")
        self.thread.start()
        for _ in range(400):  # the socket listens once uvicorn has started
            if self.uvicorn.started or not self.thread.is_alive():
                break
            threading.Event().wait(0.025)
        if not self.uvicorn.started:
            raise RuntimeError("the policy endpoint's server did not start")

    def register(self, episode: Any) -> tuple[str, str]:
        """(base URL, key) of a new episode served by `episode` (chat, complete, models)."""
        key = secrets.token_hex(16)
        with self.lock:
            self.episodes[key] = episode
        return f"http://127.0.0.1:{self.port}/episodes/{key}/v1", key

    def unregister(self, key: str) -> None:
        with self.lock:
            self.episodes.pop(key, None)

    def find(self, key: str) -> Any:
        with self.lock:
            return self.episodes.get(key)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=10)


def build_app(server: EndpointServer) -> Any:
    """The routes: `/episodes/{key}/v1/chat/completions`, `/completions` and `/models`."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(_error(400, f"{where}: {first.get('msg')}" if where else str(first.get("msg")))[1], 400)

    def episode_of(key: str) -> Any:
        episode = server.find(key)
        if episode is None:
            raise LookupError(key)
        return episode

    @app.exception_handler(LookupError)
    async def unknown(_request: Request, _exc: LookupError) -> JSONResponse:
        return JSONResponse(_error(404, "no such episode (it ended, or the URL is wrong)", "not_found")[1], 404)

    def answer(result: tuple[int, Any]) -> Any:
        status, payload = result
        if isinstance(payload, list):  # server-sent events of a streamed chat reply
            return StreamingResponse(iter(payload), media_type="text/event-stream")
        return JSONResponse(payload, status)

    @app.post("/episodes/{key}/v1/chat/completions")
    def chat(key: str, body: ChatRequest) -> Any:
        return answer(episode_of(key).chat(body))

    @app.post("/episodes/{key}/v1/completions")
    def complete(key: str, body: CompletionRequest) -> Any:
        return answer(episode_of(key).complete(body))

    @app.get("/episodes/{key}/v1/models")
    def models(key: str) -> Any:
        return JSONResponse(episode_of(key).models())

    return app


_SERVER: list[EndpointServer] = []
_SERVER_LOCK = threading.Lock()


def server() -> EndpointServer:
    """This process's endpoint server, started on first use."""
    with _SERVER_LOCK:
        if not _SERVER:
            _SERVER.append(EndpointServer())
        return _SERVER[0]
