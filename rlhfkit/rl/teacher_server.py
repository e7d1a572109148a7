"""A small HTTP server for a distillation teacher (`--teacher_url`), on the standard library's threading server.

Protocol (JSON both ways):
- `GET /info` -> {"tokenizer": fingerprint of the teacher's token -> id map (`teacher.tokenizer_fingerprint`),
  "temperature": the temperature of the log-probs served}: the student checks both at start (a different tokenizer,
  or a temperature other than its --temperature, stops the run; a server that names no temperature is not checked).
- `POST /logprobs {"input_ids": [[id, ...], ...], "prompt_lengths": [int, ...], "topk": k}` ->
  {"logprobs": [[the log-prob of each response token], ...]} and, with k > 0, "topk_logprobs" / "topk_ids"
  ([[[k numbers] per response token], ...]): row i's response is input_ids[i][prompt_lengths[i]:].
Errors are JSON {"error": ...} with status 400 (a bad request), 401 (a missing or wrong bearer token) or 413 (a body
over `max_body_bytes`).

`TeacherServer(score, fingerprint, api_key=...)` serves any `score(experience, topk)`; `serve_teacher_model(spec)`
serves a local model through `TeacherRole` (the same forward a local teacher runs, so both give the same log-probs).
With an `api_key` every request (GET /info too) needs `Authorization: Bearer <key>` (the students' --teacher_api_key;
checked before the body is read); without one anyone who reaches the port is served. It binds 127.0.0.1 unless told
otherwise; `python -m rlhfkit.cli.serve_teacher` serves a model directory and refuses another host without a key.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from rlhfkit.config.common import ModelArgs, StrategyArgs
from rlhfkit.config.distill import ServeTeacherConfig
from rlhfkit.config.serving import announce_ready, authorized, serve_until_stopped
from rlhfkit.config.specs import BatchSpec, TeacherSpec
from rlhfkit.errors import UserError
from rlhfkit.rl.experience import Experience
from rlhfkit.rl.teacher import INFO_PATH, LOGPROBS_PATH, tokenizer_fingerprint

Score = Callable[[Experience, int], dict[str, torch.Tensor]]
MAX_BODY_BYTES = 64 * 2**20
MAX_TOPK = 4096


def experience_of(body: dict[str, Any]) -> Experience:
    """The padded experience of a request (every response position an action). ValueError on a bad body."""
    rows, prompts = body.get("input_ids"), body.get("prompt_lengths")
    if not isinstance(rows, list) or not isinstance(prompts, list) or len(rows) != len(prompts) or not rows:
        raise ValueError("input_ids and prompt_lengths must be lists of one length > 0")
    if not all(isinstance(p, int) and isinstance(r, list) and 0 < p < len(r) for r, p in zip(rows, prompts)):
        raise ValueError("each row needs a prompt and at least one response token (0 < prompt_length < len)")
    width, actions = max(len(r) for r in rows), max(len(r) - p for r, p in zip(rows, prompts))
    sequences = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros_like(sequences)
    action_mask = torch.zeros((len(rows), actions), dtype=torch.bool)
    for i, (r, p) in enumerate(zip(rows, prompts)):
        sequences[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, :len(r)] = 1
        action_mask[i, :len(r) - p] = True
    return Experience(sequences=sequences, attention_mask=attention_mask,
                      prompt_lengths=torch.tensor(prompts, dtype=torch.long), action_mask=action_mask)


def answer_of(exp: Experience, scores: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Each row's scores cut to its response length, as JSON lists."""
    lengths = (exp.attention_mask.sum(dim=1) - exp.prompt_lengths).tolist()
    names = {"log_probs": "logprobs", "topk_log_probs": "topk_logprobs", "topk_ids": "topk_ids"}
    return {names[k]: [row[:n] for row, n in zip(v.tolist(), lengths)] for k, v in scores.items()}


class _JSONHandler(BaseHTTPRequestHandler):
    """JSON answers and the bearer check of the teacher's handler (`bearer`: the key to require, None: none)."""

    bearer: str | None = None

    def log_message(self, *args: Any) -> None:  # quiet: the trainer's console is the log
        pass

    def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refused(self) -> bool:
        """Answer 401 unless the request carries the bearer token (always False without a key)."""
        if authorized(self.headers.get("Authorization"), self.bearer):
            return False
        self.close_connection = True  # its body, if any, is never read
        self._send(401, {"error": "missing or wrong bearer token (the students' --teacher_api_key)"},
                   {"WWW-Authenticate": "Bearer"})
        return True


class TeacherServer:
    """Serves `score` on host:port (port 0: a free one; `url` says which) in a background thread."""

    def __init__(self, score: Score, fingerprint: str, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None,
                 temperature: float | None = None):
        lock = threading.Lock()  # one model: one forward at a time
        info: dict[str, Any] = {"tokenizer": fingerprint}
        if temperature is not None:
            info["temperature"] = temperature

        class Handler(_JSONHandler):
            bearer = api_key

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self._refused():
                    return
                if self.path != INFO_PATH:
                    return self._send(404, {"error": f"no {self.path}; try {INFO_PATH} or POST {LOGPROBS_PATH}"})
                self._send(200, info)

            def do_POST(self) -> None:  # noqa: N802
                if self._refused():
                    return
                if self.path != LOGPROBS_PATH:
                    return self._send(404, {"error": f"no {self.path}; POST {LOGPROBS_PATH}"})
                size = int(self.headers.get("Content-Length") or -1)
                if not 0 <= size <= max_body_bytes:
                    return self._send(413 if size > max_body_bytes else 411, {"error": "bad Content-Length"})
                try:
                    body = json.loads(self.rfile.read(size))
                    exp, topk = experience_of(body), int(body.get("topk", 0))
                    if not 0 <= topk <= MAX_TOPK:
                        raise ValueError(f"topk must be in [0, {MAX_TOPK}] (got {topk})")
                except (ValueError, TypeError, AttributeError) as e:
                    return self._send(400, {"error": str(e)})
                try:
                    with lock:
                        scores = score(exp, topk)
                except Exception as e:  # a token id the model does not have, say: this request fails, not the server
                    return self._send(500, {"error": f"{type(e).__name__}: {e}"})
                self._send(200, answer_of(exp, scores))

        self.host, self.api_key = host, api_key
        try:
            self.server = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:  # a port in use, an address not of this machine
            raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="teacher-server")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.server.server_port}"

    def start(self) -> TeacherServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def serve_teacher_model(spec: Any, host: str = "127.0.0.1", port: int = 0,
                        api_key: str | None = None) -> TeacherServer:
    """A started server over a local `TeacherRole` built from `spec` (a `TeacherSpec`; each request sets topk)."""
    from rlhfkit.models.loading import load_tokenizer
    from rlhfkit.rl.teacher import TeacherRole

    role = TeacherRole(spec)

    def score(exp: Experience, topk: int) -> dict[str, torch.Tensor]:
        role.spec = dataclasses.replace(spec, topk=topk)
        return role.score(exp)

    fingerprint = tokenizer_fingerprint(load_tokenizer(spec.path))
    return TeacherServer(score, fingerprint, host, port, api_key=api_key, temperature=spec.temperature).start()


def served_teacher_spec(path: str, bf16: bool, temperature: float, batch_size: int) -> TeacherSpec:
    """The spec of a teacher served on its own (serve_teacher): one process, default strategy, no packing."""
    batch = BatchSpec(train_batch_size=1, micro_train_batch_size=1, micro_rollout_batch_size=batch_size,
                      max_tokens_per_gpu=None, packed=False, max_epochs=1)
    return TeacherSpec(model=ModelArgs(pretrain=path, bf16=bf16), strategy=StrategyArgs(), batch=batch, path=path,
                       temperature=temperature, topk=0)


def run_teacher_server(cfg: ServeTeacherConfig) -> None:
    """`serve_teacher`: check the key rule and the model directory (before the model loads), serve, print the URL
    and auth mode, and stop on SIGTERM or Ctrl-C."""
    from rlhfkit.models.loading import check_model_path

    cfg.check_inputs()  # the auth rule included
    api_key = cfg.resolved_api_key()
    path = check_model_path(cfg.pretrain, "--pretrain")  # named by this command's flag, before the process group
    spec = served_teacher_spec(path, cfg.bf16, cfg.temperature, cfg.batch_size)

    def announce(server: TeacherServer) -> None:  # (--no_auth next to a key was refused: api_key is None then)
        announce_ready("serve_teacher", "teacher", server.url, f"temperature={cfg.temperature:g}",
                       bearer=bool(api_key), no_auth=cfg.no_auth, reach=server.url)

    serve_until_stopped(lambda: serve_teacher_model(spec, cfg.host, cfg.port, api_key=api_key), announce, "teacher")
