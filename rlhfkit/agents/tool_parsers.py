"""Tool calls parsed from a model's sampled text, in the published formats of the common model families.

- `hermes` (Hermes 2/3, Qwen 2.5/3): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `llama3` (Llama 3.1-3.3 JSON tool calling): `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` or bare
  as the whole message; several calls are separated by `;` (or whitespace).
- `mistral` (Mistral v3 tokenizers): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

`parse_tool_calls(text, fmt)` never raises on model output: a call that is not valid JSON, lacks a name or has
non-object arguments, or was cut off by the token budget (a partial call) becomes an entry of `errors`, which the
tool agent feeds back to the model as an error message and counts. JSON is read with `json.JSONDecoder.raw_decode`,
so nested objects and strings that contain braces or the closing tag's characters are read as JSON reads them,
not by matching brackets.

`detect_format(chat_template)` picks the format from the markers a chat template writes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes", "llama3", "mistral")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()
_SEPARATORS = re.compile(r"[\s;,]*")


@dataclass
class ToolCall:
    """One parsed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedCalls:
    """What a turn's text holds: the calls, one line per malformed or partial call, and the text outside calls."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""

    @property
    def attempted(self) -> bool:
        """The model tried to call a tool (well-formed or not)."""
        return bool(self.calls or self.errors)


def detect_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template renders, from its markers; None when it shows none."""
    template = chat_template or ""
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_TAG in template:
        return "mistral"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3"
    return None


def _call(value: Any, keys: tuple[str, ...]) -> ToolCall | str:
    """A decoded JSON value as a ToolCall, or why it is not one."""
    if not isinstance(value, dict):
        return f"a tool call must be a JSON object, got {type(value).__name__}"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return "a tool call needs a \"name\" string"
    args: Any = next((value[k] for k in keys if k in value), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string, as OpenAI's API returns them
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return f"tool call {name}: arguments are a string that is not JSON"
    if not isinstance(args, dict):
        return f"tool call {name}: arguments must be a JSON object, got {type(args).__name__}"
    return ToolCall(name, args)


def _unclosed(text: str, pos: int) -> bool:
    """The JSON that starts at text[pos] is still open (a string or a bracket) where the text ends: it was cut off."""
    depth, in_string, escaped = 0, False, False
    for ch in text[pos:]:
        if in_string:
            escaped, in_string = (not escaped and ch == "\\"), in_string and (escaped or ch != '"')
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return False
    return in_string or depth > 0


def _decode(text: str, pos: int) -> tuple[Any, int] | str:
    """The JSON value at text[pos:] and where it ends, or an error line (partial: it ran off the end of the text)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as e:
        if _unclosed(text, pos):
            return "partial tool call: the text ended inside its JSON (truncated)"
        return f"malformed tool call: {e.msg} at character {e.pos - pos}"


def _add(out: ParsedCalls, value: Any, keys: tuple[str, ...]) -> None:
    call = _call(value, keys)
    (out.calls.append(call) if isinstance(call, ToolCall) else out.errors.append(call))


def parse_hermes(text: str) -> ParsedCalls:
    out, pos, content = ParsedCalls(), 0, []
    while (start := text.find(HERMES_OPEN, pos)) >= 0:
        content.append(text[pos:start])
        body = start + len(HERMES_OPEN)
        decoded = _decode(text, len(text) - len(text[body:].lstrip()))
        if isinstance(decoded, str):
            close = text.find(HERMES_CLOSE, body)
            if close < 0:
                out.errors.append(decoded)
                return _done(out, content)
            body_text = text[body:close].strip()  # closed: its JSON is malformed, not cut off
            out.errors.append(decoded if decoded.startswith("malformed") else
                              f"malformed tool call: {body_text[:40]!r} is not complete JSON")
            pos = close + len(HERMES_CLOSE)
            continue
        value, end = decoded
        close = text.find(HERMES_CLOSE, end)
        if close < 0:
            out.errors.append(f"partial tool call: no {HERMES_CLOSE} after the call's JSON (truncated)")
            return _done(out, content)
        if text[end:close].strip():
            out.errors.append(f"malformed tool call: text after the JSON, before {HERMES_CLOSE}")
        else:
            _add(out, value, ("arguments", "parameters"))
        pos = close + len(HERMES_CLOSE)
    content.append(text[pos:])
    return _done(out, content)


def _json_sequence(text: str, pos: int, out: ParsedCalls, keys: tuple[str, ...]) -> None:
    """Calls written one after another from text[pos:] (separated by `;`, `,` or whitespace) up to the end."""
    while True:
        pos = _SEPARATORS.match(text, pos).end()  # type: ignore[union-attr]  # matches the empty string too
        if pos >= len(text):
            return
        decoded = _decode(text, pos)
        if isinstance(decoded, str):
            out.errors.append(decoded)
            return
        value, pos = decoded
        for item in value if isinstance(value, list) else [value]:
            _add(out, item, keys)


def parse_llama3(text: str) -> ParsedCalls:
    out = ParsedCalls()
    tag = text.find(PYTHON_TAG)
    if tag >= 0:
        _json_sequence(text, tag + len(PYTHON_TAG), out, ("parameters", "arguments"))
        return _done(out, [text[:tag]])
    if text.lstrip().startswith("{"):  # a bare JSON call is the whole message
        _json_sequence(text, len(text) - len(text.lstrip()), out, ("parameters", "arguments"))
        return out
    return _done(out, [text])


def parse_mistral(text: str) -> ParsedCalls:
    out = ParsedCalls()
    tag = text.find(MISTRAL_TAG)
    if tag < 0:
        return _done(out, [text])
    body = text[tag + len(MISTRAL_TAG):]
    if not body.lstrip().startswith("["):
        out.errors.append(f"malformed tool call: {MISTRAL_TAG} must be followed by a JSON list of calls")
    else:
        _json_sequence(text, tag + len(MISTRAL_TAG), out, ("arguments", "parameters"))
    return _done(out, [text[:tag]])


def _done(out: ParsedCalls, content: list[str]) -> ParsedCalls:
    out.content = "".join(content).strip()
    return out


PARSERS = {"hermes": parse_hermes, "llama3": parse_llama3, "mistral": parse_mistral}


def parse_tool_calls(text: str, fmt: str) -> ParsedCalls:
    """The tool calls in `text` written in format `fmt` (one of FORMATS)."""
    if fmt not in PARSERS:
        raise ValueError(f"tool format {fmt!r}: use one of {', '.join(FORMATS)}")
    return PARSERS[fmt](text)
