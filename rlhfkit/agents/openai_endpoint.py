"""An OpenAI-compatible endpoint over the policy, so an external agent framework drives episodes that then train.

An agent file's executor subclasses `OpenAIAgentExecutor` and implements `run_agent(base_url, prompt, label)`:
plain (blocking) client code that talks to `{base_url}/chat/completions` (or `/completions`) as it would to any
OpenAI-compatible server, and returns the episode's reward. Each episode gets its own server on 127.0.0.1 (an
ephemeral port, inside the rollout engine's process, where the episodes run); every call's exact prompt token ids
and sampled token ids (with their log-probs) are recorded into the episode's token trace:

- the first call's rendered prompt (`apply_chat_template(..., add_generation_prompt=True)` for chat, bos + text for
  completions) is the episode's prompt;
- a later call must continue the conversation the endpoint returned (the same messages, with the assistant's
  replies as returned, then new ones; for completions the previous prompt + completion text, then more). The new
  part is tokenised once and appended as feedback (action mask 0: no loss, no KL), after the sampled ids exactly
  as the engine returned them: the model is never trained on a re-tokenisation of its own words. A call that
  rewrites the history is refused (HTTP 400), as is a temperature / top-p / top-k other than the run's and a call
  past the turn budget (--max_steps) or the response budget (--generate_max_len).

The responses are OpenAI's shape (`choices[0].message.content`, `finish_reason`, `usage`, `logprobs.content`) plus
`prompt_token_ids` and `choices[0].token_ids`. Generation goes through the run's engine: calls of concurrent
episodes are batched like those of the other agents. The response budget (--generate_max_len) covers the episode.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlhfkit.agents.api import FINISH_BUDGET, FINISH_DONE, AgentExecutorBase, AgentFailure, Episode

GENERATE_TIMEOUT_S = 600.0  # one engine call, from an HTTP handler thread; bounded so a handler never hangs
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}


class EndpointError(Exception):
    """A request the endpoint refuses (HTTP 400 with this message)."""


class Trace:
    """The token trace of one episode, grown by the endpoint's calls (thread-safe: one call at a time)."""

    def __init__(self, tokenizer: Any, budget: int, max_turns: int | None = None):
        self.tokenizer = tokenizer
        self.budget, self.max_turns = budget, max_turns
        self.episode: Episode | None = None
        self.history: Any = None  # what the next call must start with: chat messages or completion text
        self.stopped = True  # the last sample ended with eos (else the rendered history's eos is feedback)
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def context(self, history: Any, rendered: str, previous: str | None, first_ids: list[int]) -> list[int]:
        """The token ids this call continues from; appends the new part as feedback (mask 0). A chat template
        closes each assistant turn with eos: after a reply cut by its token budget that eos is feedback too."""
        if self.episode is None:
            self.episode = Episode(prompt_ids=list(first_ids))
            return list(first_ids)
        if previous is None or not rendered.startswith(previous) or not _continues(history, self.history):
            raise EndpointError("this call does not continue the episode's conversation (send back the earlier "
                                "messages and replies unchanged, then the new ones): token in, token out")
        eos = self.tokenizer.eos_token_id
        close = isinstance(history, list) and not self.stopped and eos is not None
        feedback = ([eos] if close else []) + \
            self.tokenizer.encode(rendered[len(previous):], add_special_tokens=False)
        episode = self.episode
        episode.response_ids += feedback
        episode.logprobs += [0.0] * len(feedback)
        episode.action_mask += [0] * len(feedback)
        episode.feedback_tokens += len(feedback)
        return episode.prompt_ids + episode.response_ids

    def record(self, context: list[int], sample: Any) -> None:
        action = list(sample.response_ids)
        episode = self.episode
        if episode is None:
            raise RuntimeError("Trace.record() before Trace.context() opened the episode")
        episode.response_ids += action
        episode.logprobs += list(sample.logprobs) + [0.0] * (len(action) - len(sample.logprobs))
        episode.action_mask += [1] * len(action)
        episode.turns += 1
        eos = self.tokenizer.eos_token_id
        self.stopped = bool(action) and action[-1] == eos
        self.calls.append({"prompt_ids": list(context), "response_ids": action, "logprobs": list(sample.logprobs)})

    def room(self) -> int:
        return self.budget - (len(self.episode.response_ids) if self.episode else 0)


def _continues(new: Any, old: Any) -> bool:
    if isinstance(old, list):
        return isinstance(new, list) and new[:len(old)] == old
    return isinstance(new, str) and new.startswith(old)


class PolicyEndpoint:
    """One episode's server: `/v1/chat/completions`, `/v1/completions`, `/v1/models` on 127.0.0.1."""

    def __init__(self, trace: Trace, llm_engine: Any, sampling_params: dict, loop: asyncio.AbstractEventLoop,
                 model: str = "policy"):
        self.trace, self.llm_engine, self.loop, self.model = trace, llm_engine, loop, model
        self.sampling = dict(sampling_params or {})
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # no per-request lines on stderr
                pass

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": endpoint.model, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    body = json.loads(self.rfile.read(length) or b"{}")
                    route = self.path.rstrip("/")
                    if route == "/v1/chat/completions":
                        self._send(200, endpoint.chat(body))
                    elif route == "/v1/completions":
                        self._send(200, endpoint.complete(body))
                    else:
                        self._send(404, {"error": {"message": f"no route {self.path}"}})
                except (EndpointError, ValueError, KeyError, TypeError) as e:
                    self._send(400, {"error": {"message": f"{type(e).__name__}: {e}", "type": "invalid_request"}})

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    # -- the two completion routes ---------------------------------------------------------------------------
    def chat(self, body: dict) -> dict:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise EndpointError("messages must be a non-empty list")
        messages = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
        tok = self.trace.tokenizer
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with self.trace.lock:
            previous = None
            if self.trace.history is not None:
                previous = tok.apply_chat_template(self.trace.history, tokenize=False)
            sample, context = self._generate(body, messages, rendered, previous,
                                             tok.encode(rendered, add_special_tokens=False))
            text = tok.decode(sample.response_ids, skip_special_tokens=True)
            self.trace.history = messages + [{"role": "assistant", "content": text}]
        return self._reply("chat.completion", {"message": {"role": "assistant", "content": text}}, sample, context)

    def complete(self, body: dict) -> dict:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise EndpointError("prompt must be one string")
        tok = self.trace.tokenizer
        bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
        with self.trace.lock:
            sample, context = self._generate(body, prompt, prompt, self.trace.history,
                                             bos + tok.encode(prompt, add_special_tokens=False))
            text = tok.decode(sample.response_ids, skip_special_tokens=True)
            self.trace.history = prompt + text
        return self._reply("text_completion", {"text": text}, sample, context)

    def _generate(self, body: dict, history: Any, rendered: str, previous: str | None,
                  first_ids: list[int]) -> tuple[Any, list[int]]:
        for key, run_key in SAMPLING.items():
            if body.get(key) is not None and run_key in self.sampling and body[key] != self.sampling[run_key]:
                raise EndpointError(f"{key}={body[key]} differs from the run's {self.sampling[run_key]}: the "
                                    "trainer's log-probs assume the run's sampling settings")
        episode = self.trace.episode
        if self.trace.max_turns and episode is not None and episode.turns >= self.trace.max_turns:
            raise EndpointError(f"the episode's turn budget (--max_steps {self.trace.max_turns}) is spent")
        context = self.trace.context(history, rendered, previous, first_ids)
        room = self.trace.room()
        if room <= 0:
            raise EndpointError("the episode's response budget (--generate_max_len) is spent")
        wanted = body.get("max_completion_tokens") or body.get("max_tokens")
        budget = min(room, int(wanted)) if wanted else room
        future = asyncio.run_coroutine_threadsafe(self.llm_engine.generate(context, budget, self.sampling), self.loop)
        sample = future.result(timeout=GENERATE_TIMEOUT_S)
        self.trace.record(context, sample)
        return sample, context

    def _reply(self, kind: str, choice: dict, sample: Any, context: list[int]) -> dict:
        tok = self.trace.tokenizer
        ids = list(sample.response_ids)
        finish = "stop" if self.trace.stopped else "length"
        logprobs = {"content": [{"token": tok.convert_ids_to_tokens(t), "logprob": lp}
                                for t, lp in zip(ids, sample.logprobs)]}
        return {"id": f"rlhfkit-{len(self.trace.calls)}", "object": kind, "created": int(time.time()),
                "model": self.model, "prompt_token_ids": list(context),
                "choices": [{"index": 0, **choice, "finish_reason": finish, "token_ids": ids, "logprobs": logprobs}],
                "usage": {"prompt_tokens": len(context), "completion_tokens": len(ids),
                          "total_tokens": len(context) + len(ids)}}


class OpenAIAgentExecutor(AgentExecutorBase):
    """An executor whose episodes an external agent drives through an OpenAI-compatible endpoint.

    Subclass it in an agent file (`class AgentExecutor(OpenAIAgentExecutor)`) and implement
    `run_agent(base_url, prompt, label) -> reward` (blocking client code; it runs in a thread while the endpoint
    serves it). The episode's trace is what the endpoint recorded; its reward is what run_agent returns."""

    def __init__(self) -> None:
        super().__init__(None)

    def run_agent(self, base_url: str, prompt: str, label: Any) -> float:
        raise NotImplementedError("AgentExecutor.run_agent(base_url, prompt, label) must drive the episode through "
                                  "{base_url}/chat/completions and return its reward")

    async def execute(self, prompt: str, label: Any, sampling_params: Any, max_length: int | None = None,
                      hf_tokenizer: Any = None, llm_engine: Any = None) -> Episode:
        tokenizer = hf_tokenizer or self.hf_tokenizer
        trace = Trace(tokenizer, self._budget(max_length), self.max_steps)
        endpoint = PolicyEndpoint(trace, llm_engine or self.llm_engine, dict(sampling_params or {}),
                                  asyncio.get_running_loop())
        failure = None
        try:
            reward = await self._user("run_agent", asyncio.to_thread(self.run_agent, endpoint.base_url, str(prompt),
                                                                     label))
        except AgentFailure as e:
            failure, reward = e, 0.0
        finally:
            endpoint.close()
        episode = trace.episode
        if episode is None:  # the agent never called the endpoint: nothing was sampled, nothing to train on
            ids = self._prompt_ids(str(prompt), prompt)
            return Episode(prompt_ids=ids, finish="failed", error="exception: run_agent made no completion call")
        episode.reward = float(reward or 0.0)
        episode.score = episode.reward
        episode.finish = FINISH_BUDGET if trace.room() <= 0 else FINISH_DONE
        if failure is not None:
            episode.finish, episode.error = "failed", f"{failure.kind}: {failure}"
        return episode
