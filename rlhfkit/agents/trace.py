"""One agent episode as the run report's trace viewer shows it (rlhfkit.logging.trace_view).

An episode's response is one token list with an action mask (rlhfkit.agents.api): runs of sampled tokens (mask 1,
trained) and of environment feedback (mask 0, context only). `episode_trace` cuts it back into turns: each turn is
the text the policy sampled, the tool calls its environment ran with their results, the feedback it got, and the
turn's reward, taken from the episode's `turn_log` (what the multi-turn loop noted per turn). Tokens past the logged
turns (the turn whose `step` failed, or an episode built without a log: an OpenAI-endpoint or OpenRLHF-dict
episode) are cut at the mask's runs, one turn per run of sampled tokens and the feedback after it, reward unknown.

A trace is small and plain JSON: texts longer than `MAX_TEXT` characters keep their head and tail, a turn keeps at
most `MAX_CALLS` tool calls. The rollout source keeps `trace_fields` of every episode with the batch's texts and
decodes traces only for the few rows the run report keeps (samples.jsonl), on the trainer's side.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

MAX_TEXT = 4000  # characters of one text (prompt, action, feedback, tool arguments or result)
MAX_CALLS = 16  # tool calls kept per turn
FIELDS = ("prompt_ids", "response_ids", "action_mask", "turn_log", "reward", "score", "finish", "truncated", "error")


def trace_fields(episode: dict[str, Any]) -> dict[str, Any]:
    """What `episode_trace` reads of a `run_episodes` dict (not its log-probs), kept until the report asks."""
    return {k: episode[k] for k in FIELDS if k in episode}


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """`text`, or its head and tail with the number of characters cut between them."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def turn_spans(mask: Sequence[int], actions: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """(start, end of the action, end of the feedback) of each turn of a response with action mask `mask`, whose
    first turns sampled `actions` tokens each; None when those counts do not fit the mask (a log that does not
    describe these tokens)."""
    spans, pos, n = [], 0, len(mask)
    for count in actions:
        if count < 0 or pos + count > n or not all(mask[pos:pos + count]):
            return None
        end = pos + count
        while end < n and not mask[end]:
            end += 1
        spans.append((pos, pos + count, end))
        pos = end
    while pos < n:  # unlogged turns: a run of sampled tokens, then the feedback run after it
        mid = pos
        while mid < n and mask[mid]:
            mid += 1
        end = mid
        while end < n and not mask[end]:
            end += 1
        spans.append((pos, mid, end))
        pos = end
    return spans


def _plain(value: Any) -> Any:
    """A JSON value for tool arguments (clipped to a string when its JSON is longer than MAX_TEXT)."""
    text = json.dumps(value, default=str)
    return json.loads(text) if len(text) <= MAX_TEXT else clip(text)


def _call(call: Any) -> dict[str, Any]:
    call = call if isinstance(call, dict) else {"result": str(call)}
    name = call.get("name")
    return {"name": None if name is None else str(name), "arguments": _plain(call.get("arguments")),
            "result": clip(str(call.get("result", ""))), "ok": bool(call.get("ok", True))}


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def episode_trace(episode: dict[str, Any], decode: Callable[[list[int]], str], reward: float) -> dict[str, Any]:
    """The trace of one finished episode (a `run_episodes` dict); `reward`: what it trained with (the fallback
    for a failed episode)."""
    mask, ids = [int(m) for m in episode["action_mask"]], list(episode["response_ids"])
    log = [t for t in episode.get("turn_log") or [] if isinstance(t, dict)]
    spans = turn_spans(mask, [int(t.get("action_tokens", 0)) for t in log])
    if spans is None:
        log, spans = [], turn_spans(mask, []) or []
    turns = []
    for k, (start, mid, end) in enumerate(spans):
        record = log[k] if k < len(log) else None
        turns.append({"action": clip(decode(ids[start:mid])), "action_tokens": mid - start,
                      "feedback": clip(decode(ids[mid:end])), "feedback_tokens": end - mid,
                      "reward": None if record is None else _number(record.get("reward")),
                      "tool_calls": [_call(c) for c in (record or {}).get("tool_calls", [])[:MAX_CALLS]]})
    prompt_ids = list(episode["prompt_ids"])
    return {"prompt": clip(decode(prompt_ids)), "prompt_tokens": len(prompt_ids), "turns": turns,
            "reward": _number(reward), "env_reward": _number(episode.get("reward")),
            "score": _number(episode.get("score")), "finish": str(episode.get("finish", "")),
            "truncated": bool(episode.get("truncated")), "error": clip(str(episode.get("error") or "")),
            "trained_tokens": sum(mask), "feedback_tokens": len(mask) - sum(mask)}


def episode_traces(episodes: Sequence[dict[str, Any]], tokenizer: Any, rewards: Sequence[float]) -> list[dict]:
    """The traces of a step's episodes, special tokens shown (the model sampled them, and they train)."""
    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False)) if ids else ""

    return [episode_trace(e, decode, r) for e, r in zip(episodes, rewards)]
