"""An OpenAI-compatible endpoint over the policy, so an external agent framework drives episodes that then train.

An agent file's executor subclasses `OpenAIAgentExecutor` and implements `run_agent(base_url, prompt, label)`:
plain (blocking) client code that talks to `{base_url}/chat/completions` (or `/completions`) as it would to any
OpenAI-compatible server, the official `openai` client included (`OpenAI(base_url=base_url, api_key="-")`), and
returns the episode's reward. The rollout engine's process runs one server (rlhfkit/agents/endpoint_server.py:
FastAPI on uvicorn, 127.0.0.1 only, body limits and timeouts); each episode has its own base URL there. Every
call's exact prompt token ids and sampled token ids (with their log-probs) are recorded into the episode's trace:

- the first call's rendered prompt (`apply_chat_template(..., add_generation_prompt=True)` for chat, with the
  request's `tools`; bos (once) + text for completions) is the episode's prompt;
- a later call must continue the conversation the endpoint returned (the same messages, with the assistant's
  replies as returned, tool calls included, then new ones such as `tool` results; for completions the previous
  prompt + completion text, then more). The new part is tokenised once and appended as feedback (action mask 0:
  no loss, no KL), after the sampled ids exactly as the engine returned them: the model is never trained on a
  re-tokenisation of its own words. A call that rewrites the history is refused (HTTP 400), as is a temperature /
  top-p / top-k other than the run's and a call past the turn budget (--max_steps) or the response budget
  (--generate_max_len). A refused call leaves the trace as it was.

Tool calling: with `tools` in the request, the reply's text is parsed for tool calls in the tokenizer's format
(rlhfkit/agents/tool_parsers.py: Hermes/Qwen, Llama 3, Mistral, from the chat template's markers) and returned as
`tool_calls` with `finish_reason` "tool_calls". `stream: true` returns the reply as server-sent
`chat.completion.chunk` events (the whole turn is sampled in one batched engine call, then sent).

The responses are OpenAI's shape (`choices[0].message`, `finish_reason`, `usage`, `logprobs.content`) plus
`prompt_token_ids` and `choices[0].token_ids`. Generation goes through the run's engine: calls of concurrent
episodes are batched like those of the other agents.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from rlhfkit.agents.api import FINISH_BUDGET, FINISH_DONE, AgentExecutorBase, AgentFailure, Episode
from rlhfkit.agents.watchdog import in_daemon_thread

GENERATE_TIMEOUT_S = 600.0  # one engine call, from a request's thread; bounded so a request never hangs
SAMPLING = ("temperature", "top_p", "top_k")


class EndpointError(Exception):
    """A request the endpoint refuses (HTTP 400 with this message)."""


class Trace:
    """The token trace of one episode, grown by the endpoint's calls (one call at a time: `lock`)."""

    def __init__(self, tokenizer: Any, budget: int, max_turns: int | None = None):
        self.tokenizer = tokenizer
        self.budget, self.max_turns = budget, max_turns
        self.episode: Episode | None = None
        self.history: Any = None  # what the next call must start with: chat messages or completion text
        self.stopped = True  # the last sample ended with eos (else the rendered history's eos is feedback)
        self.calls: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def feedback(self, history: Any, rendered: str, previous: str | None) -> list[int]:
        """The token ids this call adds before sampling (nothing is changed yet). A chat template closes each
        assistant turn with eos: after a reply cut by its token budget that eos is feedback too."""
        if previous is None or not rendered.startswith(previous) or not _continues(history, self.history):
            raise EndpointError("this call does not continue the episode's conversation (send back the earlier "
                                "messages and replies unchanged, then the new ones): token in, token out")
        eos = self.tokenizer.eos_token_id
        chat = isinstance(history, list)
        close = chat and not self.stopped and eos is not None
        # The trace ends where the reply's eos is; what a template writes after it (Qwen's "\n" after <|im_end|>)
        # is feedback, like the new turns.
        cut, eos_text = len(previous), self.tokenizer.eos_token
        if chat and eos_text and eos_text in previous:
            cut = previous.rindex(eos_text) + len(eos_text)
        return ([eos] if close else []) + self.tokenizer.encode(rendered[cut:], add_special_tokens=False)

    def room(self, adding: int = 0) -> int:
        return self.budget - (len(self.episode.response_ids) if self.episode else 0) - adding

    def record(self, first_ids: list[int], feedback: list[int], sample: Any) -> list[int]:
        """Append a served call: the feedback (mask 0), then the sampled ids (mask 1). Returns the call's context."""
        if self.episode is None:
            self.episode = Episode(prompt_ids=list(first_ids))
        episode = self.episode
        episode.response_ids += feedback
        episode.logprobs += [0.0] * len(feedback)
        episode.action_mask += [0] * len(feedback)
        episode.feedback_tokens += len(feedback)
        context = episode.prompt_ids + episode.response_ids
        action = list(sample.response_ids)
        episode.response_ids += action
        episode.logprobs += list(sample.logprobs) + [0.0] * (len(action) - len(sample.logprobs))
        episode.action_mask += [1] * len(action)
        episode.turns += 1
        self.stopped = bool(action) and action[-1] == self.tokenizer.eos_token_id
        self.calls.append({"prompt_ids": list(context), "response_ids": action, "logprobs": list(sample.logprobs)})
        return context


def context_limit(tokenizer: Any) -> int | None:
    """The model's context in tokens, from its tokenizer's `model_max_length` (None when unset: Transformers then
    holds a huge sentinel)."""
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**9 else None


def _continues(new: Any, old: Any) -> bool:
    if isinstance(old, list):
        return isinstance(new, list) and new[:len(old)] == old
    return isinstance(new, str) and new.startswith(old)


class EpisodeEndpoint:
    """What one episode's requests do; the process's server (endpoint_server.py) routes them here. Each route
    returns (HTTP status, JSON payload or the server-sent events of a streamed reply)."""

    def __init__(self, trace: Trace, llm_engine: Any, sampling_params: dict, loop: asyncio.AbstractEventLoop,
                 model: str = "policy"):
        from rlhfkit.agents.tool_parsers import detect_format

        self.trace, self.llm_engine, self.loop, self.model = trace, llm_engine, loop, model
        self.sampling = dict(sampling_params or {})
        self.tool_format = detect_format(getattr(trace.tokenizer, "chat_template", None))

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model, "object": "model"}]}

    def chat(self, body: Any) -> tuple[int, Any]:
        from rlhfkit.agents.openai_schema import sse_chunks

        try:
            reply = self._chat(body)
        except EndpointError as e:
            return 400, {"error": {"message": f"EndpointError: {e}", "type": "invalid_request_error"}}
        return 200, (sse_chunks(reply) if body.stream else reply)

    def complete(self, body: Any) -> tuple[int, Any]:
        try:
            if body.stream:
                raise EndpointError("stream is served on /chat/completions only")
            from rlhfkit.data.tokens import encode, with_bos

            tok = self.trace.tokenizer
            with self.trace.lock:  # bos once, also when the prompt text starts with it
                sample, context = self._generate(body, body.prompt, body.prompt, self.trace.history,
                                                 with_bos(tok, encode(tok, body.prompt)))
                text = tok.decode(sample.response_ids, skip_special_tokens=True)
                self.trace.history = body.prompt + text
        except EndpointError as e:
            return 400, {"error": {"message": f"EndpointError: {e}", "type": "invalid_request_error"}}
        finish = "stop" if self.trace.stopped else "length"
        return 200, self._reply("text_completion", {"text": text}, sample, context, finish)

    def _render(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        from rlhfkit.agents.openai_schema import for_template

        extra = {"tools": tools} if tools else {}
        return self.trace.tokenizer.apply_chat_template(for_template(messages), tokenize=False,
                                                        add_generation_prompt=generation, **extra)

    def _chat(self, body: Any) -> dict:
        from rlhfkit.agents.openai_schema import normalized

        messages = normalized(body.messages)
        tools = [t.model_dump() for t in body.tools] if body.tools else None
        rendered = self._render(messages, tools, generation=True)
        with self.trace.lock:
            history = self.trace.history
            previous = None if history is None else self._render(history, tools, generation=False)
            sample, context = self._generate(body, messages, rendered, previous,
                                             self.trace.tokenizer.encode(rendered, add_special_tokens=False))
            message, reply, finish = self._message(sample, tools, body.tool_choice)
            self.trace.history = messages + [message]
        return self._reply("chat.completion", {"message": reply}, sample, context, finish)

    def _message(self, sample: Any, tools: list[dict] | None, tool_choice: Any) -> tuple[dict, dict, str]:
        """(the assistant message as the history keeps it, as the reply shows it, finish reason)."""
        from rlhfkit.agents.openai_schema import tool_calls_out
        from rlhfkit.agents.tool_parsers import parse_tool_calls

        tok = self.trace.tokenizer
        finish = "stop" if self.trace.stopped else "length"
        text = tok.decode(sample.response_ids, skip_special_tokens=True)
        if tools and tool_choice != "none" and self.tool_format:
            eos = tok.eos_token_id
            raw = tok.decode([t for t in sample.response_ids if t != eos], skip_special_tokens=False)
            parsed = parse_tool_calls(raw, self.tool_format)
            if parsed.calls:
                calls = tool_calls_out(parsed.calls)
                kept = {"role": "assistant", "content": parsed.content, "tool_calls": calls}
                return kept, {**kept, "content": parsed.content or None}, "tool_calls"
        message = {"role": "assistant", "content": text}
        return message, message, finish

    def _generate(self, body: Any, history: Any, rendered: str, previous: str | None,
                  first_ids: list[int]) -> tuple[Any, list[int]]:
        """Check the call, sample its reply, record both; nothing is recorded for a refused call."""
        for key in SAMPLING:
            value = getattr(body, key, None)
            if value is not None and key in self.sampling and value != self.sampling[key]:
                raise EndpointError(f"{key}={value} differs from the run's {self.sampling[key]}: the trainer's "
                                    "log-probs assume the run's sampling settings")
        episode = self.trace.episode
        if self.trace.max_turns and episode is not None and episode.turns >= self.trace.max_turns:
            raise EndpointError(f"the episode's turn budget (--max_steps {self.trace.max_turns}) is spent")
        feedback = [] if episode is None else self.trace.feedback(history, rendered, previous)
        room = self.trace.room(len(feedback))
        if room <= 0:
            raise EndpointError("the episode's response budget (--generate_max_len) is spent")
        wanted = body.max_completion_tokens or body.max_tokens
        budget = min(room, int(wanted)) if wanted else room
        context = first_ids if episode is None else episode.prompt_ids + episode.response_ids + feedback
        limit = context_limit(self.trace.tokenizer)
        if limit is not None and len(context) >= limit:  # refused before the engine, the trace or the reply see it
            raise EndpointError(f"the conversation has {len(context)} tokens, at or over the model's context of "
                                f"{limit} (its tokenizer's model_max_length): shorten it")
        budget = min(budget, limit - len(context)) if limit is not None else budget
        future = asyncio.run_coroutine_threadsafe(self.llm_engine.generate(context, budget, self.sampling), self.loop)
        sample = future.result(timeout=GENERATE_TIMEOUT_S)
        return sample, self.trace.record(first_ids, feedback, sample)

    def _reply(self, kind: str, choice: dict, sample: Any, context: list[int], finish: str) -> dict:
        tok = self.trace.tokenizer
        ids = list(sample.response_ids)
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
    `run_agent(base_url, prompt, label) -> reward` (blocking client code; in a run it runs in an agent worker
    process, on a fresh `AgentExecutor()`, while the endpoint serves it: an exit, a hang or a crash costs its
    episode). The episode's trace is what the endpoint recorded; its reward is what run_agent returns."""

    def __init__(self) -> None:
        super().__init__(None)

    def run_agent(self, base_url: str, prompt: str, label: Any) -> float:
        raise NotImplementedError("AgentExecutor.run_agent(base_url, prompt, label) must drive the episode through "
                                  "{base_url}/chat/completions and return its reward")

    async def execute(self, prompt: str, label: Any, sampling_params: Any, max_length: int | None = None,
                      hf_tokenizer: Any = None, llm_engine: Any = None) -> Episode:
        tokenizer = hf_tokenizer or self.hf_tokenizer
        from rlhfkit.agents.endpoint_server import server

        trace = Trace(tokenizer, self._budget(max_length), self.max_steps)
        endpoint = EpisodeEndpoint(trace, llm_engine or self.llm_engine, dict(sampling_params or {}),
                                   asyncio.get_running_loop())
        base_url, key = server().register(endpoint)
        failure, reward = None, 0.0
        try:
            reward = float(await self._run_agent(base_url, str(prompt), label) or 0.0)
        except AgentFailure as e:
            failure = e
        except (TypeError, ValueError) as e:  # run_agent's return value is no number
            failure = AgentFailure("bad_output", f"run_agent returned no number ({e})")
        finally:
            server().unregister(key)
        episode = trace.episode
        if episode is None:  # the agent never called the endpoint: nothing was sampled, nothing to train on
            ids = self._prompt_ids(str(prompt), prompt)
            error = f"{failure.kind}: {failure}" if failure else "exception: run_agent made no completion call"
            return Episode(prompt_ids=ids, finish="failed", error=error)
        episode.reward = episode.score = reward  # a NaN one: episodes_to_samples counts it as failed
        episode.finish = FINISH_BUDGET if trace.room() <= 0 else FINISH_DONE
        if failure is not None:
            episode.finish, episode.error = "failed", f"{failure.kind}: {failure}"
        return episode

    async def _run_agent(self, base_url: str, prompt: str, label: Any) -> Any:
        """`run_agent` in a worker process (`run_agent_remote`, set by rlhfkit.agents.isolation: bounded by the
        worker's timeout), else in a daemon thread bounded by the step timeout (never asyncio.to_thread, whose pool
        asyncio.run joins at shutdown: a blocking run_agent would hang the run)."""
        remote = getattr(self, "run_agent_remote", None)
        if remote is not None:
            return await remote(base_url, prompt, label)
        return await self._user("run_agent", in_daemon_thread("run_agent", self.run_agent, base_url, prompt, label))
