"""Episode traces for the run report (rlhfkit.agents.trace): turns cut from the action mask and the turn log, the
fallback for tokens no log describes, clipping, and what the multi-turn loop logs per turn."""

from __future__ import annotations

import asyncio
import json

from rlhfkit.agents.api import AgentExecutorBase, AgentInstanceBase
from rlhfkit.agents.trace import MAX_TEXT, clip, episode_trace, turn_spans
from rlhfkit.rollout.engine import FINISH_STOP, SampledSequence


def decode(ids: list[int]) -> str:
    return " ".join(str(i) for i in ids)


def test_turn_spans_follow_the_log_then_the_mask_runs():
    mask = [1, 1, 0, 0, 0, 1, 0, 1, 1]
    assert turn_spans(mask, [2, 1]) == [(0, 2, 5), (5, 6, 7), (7, 9, 9)]  # the last turn is not logged
    assert turn_spans(mask, []) == [(0, 2, 5), (5, 6, 7), (7, 9, 9)]
    assert turn_spans(mask, [0]) == [(0, 0, 0), (0, 2, 5), (5, 6, 7), (7, 9, 9)]  # a turn that sampled nothing
    assert turn_spans([0, 0, 1], []) == [(0, 0, 2), (2, 3, 3)]  # feedback first (e.g. an endpoint episode)
    assert turn_spans(mask, [3]) is None  # the log does not describe these tokens (a feedback token in the action)
    assert turn_spans(mask, [2, 1, 2, 1]) is None  # more logged than sampled
    assert turn_spans([], []) == []


def test_a_trace_has_each_turn_with_its_log_and_a_failed_turn_without():
    episode = {"prompt_ids": [1, 2], "response_ids": [10, 11, 20, 21, 30], "action_mask": [1, 1, 0, 0, 1],
               "reward": 0.5, "score": None, "finish": "failed", "truncated": False,
               "error": "exception: step raised ValueError: boom",
               "turn_log": [{"reward": 0.5, "action_tokens": 2, "done": False,
                             "tool_calls": [{"name": "calc", "arguments": {"x": "</script>"}, "result": "3",
                                             "ok": True}, "not a dict"]}]}
    trace = episode_trace(episode, decode, reward=-1.0)
    assert json.loads(json.dumps(trace)) == trace  # plain JSON
    first, second = trace["turns"]
    assert (first["action"], first["feedback"], first["action_tokens"], first["feedback_tokens"]) == \
        ("10 11", "20 21", 2, 2)
    assert first["reward"] == 0.5 and first["tool_calls"] == [
        {"name": "calc", "arguments": {"x": "</script>"}, "result": "3", "ok": True},
        {"name": None, "arguments": None, "result": "not a dict", "ok": True}]
    assert second == {"action": "30", "action_tokens": 1, "feedback": "", "feedback_tokens": 0, "reward": None,
                      "tool_calls": []}  # the turn whose step raised: no log
    assert (trace["reward"], trace["env_reward"], trace["finish"], trace["trained_tokens"],
            trace["feedback_tokens"], trace["prompt"]) == (-1.0, 0.5, "failed", 3, 2, "1 2")
    assert trace["error"].startswith("exception")


def test_a_log_that_does_not_fit_the_tokens_is_ignored_and_long_texts_are_clipped():
    episode = {"prompt_ids": [], "response_ids": [1] * 3, "action_mask": [1, 0, 1], "reward": float("nan"),
               "finish": "done", "turn_log": [{"reward": 1.0, "action_tokens": 3}]}
    trace = episode_trace(episode, lambda ids: "x" * (MAX_TEXT * 3), reward=0.0)
    assert [t["reward"] for t in trace["turns"]] == [None, None] and trace["env_reward"] is None
    assert all(len(t["action"]) < MAX_TEXT + 100 for t in trace["turns"])
    assert clip("abcdef", 4) == "ab\n[... 2 characters cut ...]\nef" and clip("abc", 4) == "abc"


class _Tok:
    bos_token_id = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class _Agent(AgentInstanceBase):
    async def step(self, states, **kwargs):
        done = states["action_text"] == "b"
        return {"rewards": 1.0 if done else 0.25, "environment_feedback": "fb", "done": done,
                "tool_calls": [{"name": "t", "arguments": {}, "result": "r", "ok": True}]}


def test_the_multi_turn_loop_logs_each_turn():
    turns = iter(["aa", "b"])

    class Engine:
        async def generate(self, context, max_new_tokens, sampling_params):
            ids = [ord(c) for c in next(turns)]
            return SampledSequence(list(context), ids, [-1.0] * len(ids), FINISH_STOP)

    executor = AgentExecutorBase(_Agent, max_steps=5, max_length=50, llm_engine=Engine(), hf_tokenizer=_Tok())
    episode = asyncio.run(executor.execute("q", None, {}))
    assert [(t["reward"], t["action_tokens"], t["done"]) for t in episode.turn_log] == [(0.25, 2, False),
                                                                                         (1.0, 1, True)]
    assert episode.turn_log[0]["tool_calls"] == [{"name": "t", "arguments": {}, "result": "r", "ok": True}]
    assert episode.action_mask == [1, 1, 0, 0, 1] and episode.feedback_tokens == 2


def test_the_report_rows_of_a_rollout_decode_the_traces_of_the_kept_rows_only():
    import torch

    from rlhfkit.agents.trace import trace_fields
    from rlhfkit.rl.rollout_source import REPORT_ROLLOUTS_PER_STEP, Rollout

    decoded = []

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(list(ids))
            return decode(ids)

    episodes = [{"prompt_ids": [1], "response_ids": [i, 0], "logprobs": [-1.0, 0.0], "action_mask": [1, 0],
                 "reward": float(i), "score": None, "finish": "done", "truncated": False, "error": "",
                 "turn_log": [{"reward": float(i), "action_tokens": 1, "tool_calls": []}]} for i in range(6)]
    kept = [trace_fields(e) for e in episodes]
    assert all("logprobs" not in e for e in kept)
    rollout = Rollout(None, {"prompts": ["p"] * 6, "queries": ["pq"] * 6, "episodes": kept},  # type: ignore[arg-type]
                      {"rewards": torch.arange(6.0) / 2})
    assert all("trace" not in row for row in rollout.report_rows())  # no tokenizer: no trace
    rows = rollout.report_rows(Tok())
    assert len(rows) == REPORT_ROLLOUTS_PER_STEP == 4
    assert [(r["trace"]["env_reward"], r["trace"]["reward"], r["reward"]) for r in rows] == \
        [(float(i), i / 2, i / 2) for i in range(4)]
    assert len(decoded) == 4 * 3  # prompt, action and feedback of the kept rows only
