"""The OpenAI request and response shapes the policy endpoint speaks (rlhfkit/agents/openai_endpoint.py).

Requests are checked by pydantic before the episode sees them: every OpenAI role (system, developer, user,
assistant, tool), content as a string or a list of text parts, tool calls on assistant messages, `tools` as
function schemas, `max_tokens` a positive integer below `MAX_TOKENS`, one choice (`n` = 1). Fields the endpoint does
not act on (`frequency_penalty`, `user`, ...) are accepted and ignored, as OpenAI-compatible servers do; the sampling
fields the trainer's log-probs depend on are checked against the run's by the endpoint.

`normalized(messages)` is the one form messages are compared and rendered in: content a string, tool-call
arguments a JSON string (what the endpoint returned), so a client that echoes a reply back in another but equal
form still continues the conversation.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOKENS = 1_000_000  # a bound far above any budget: `max_tokens` past it is a malformed request, not a wish


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = Field(default="", max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(default=None, max_length=256)


class FunctionSchema(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=256)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionSchema


class Sampling(BaseModel):
    """What both routes share."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = None
    n: Literal[1] = 1
    stream: bool = False


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1, max_length=10_000)
    tools: list[Tool] | None = Field(default=None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None


class CompletionRequest(Sampling):
    prompt: str = Field(max_length=10_000_000)


def _text(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _arguments(value: str | dict[str, Any]) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def normalized(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as plain dicts in one form: content a string, tool calls with JSON-string arguments."""
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": _text(m.content)}
        if m.tool_calls:
            item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            item["name"] = m.name
        out.append(item)
    return out


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalized messages as chat templates read them: tool-call arguments as objects where they parse."""
    out = []
    for m in messages:
        if "tool_calls" in m:
            calls = []
            for c in m["tool_calls"]:
                try:
                    args: Any = json.loads(c["function"]["arguments"])
                except ValueError:
                    args = c["function"]["arguments"]
                calls.append({**c, "function": {"name": c["function"]["name"], "arguments": args}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def tool_calls_out(calls: list[Any]) -> list[dict[str, Any]]:
    """Parsed calls (rlhfkit.agents.tool_parsers.ToolCall) as OpenAI's `tool_calls`."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def sse_chunks(reply: dict[str, Any]) -> list[str]:
    """A chat reply as `chat.completion.chunk` server-sent events: the role, the content, the tool calls, the finish
    reason, then `[DONE]`. The engine samples a whole turn in one batched call, so the chunks follow it at once."""
    choice = reply["choices"][0]
    message = choice["message"]
    base = {"id": reply["id"], "object": "chat.completion.chunk", "created": reply.get("created", int(time.time())),
            "model": reply["model"]}
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if message.get("content"):
        deltas.append({"content": message["content"]})
    for i, call in enumerate(message.get("tool_calls") or []):
        deltas.append({"tool_calls": [{"index": i, **call}]})
    events = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    events.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}],
                   "usage": reply["usage"]})
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
