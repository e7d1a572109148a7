"""The reward of `reasoning_gym:` tasks (rlhfkit/data/generated_tasks.py): each reply scored by its task's own scorer.

Select it with `--remote_rm_url reasoning_gym` (or this file's path). It is an ordinary reward function file, so it
runs in the reward workers with `--reward_timeout`. The answer is read from `<answer>...</answer>` when the reply has
the tags (reasoning-gym's own prompt format), else the whole reply; when the expected answer is a number and the
reply is not, the last number in the reply is scored instead. Rewards are the scorer's, in [0, 1] (reasoning-gym
gives a small partial score to some wrong answers, e.g. 0.01).
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@cache
def _scorer(task: str) -> Any:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def answer_of(reply: str, expected: str) -> str:
    """What to score: the tagged answer, else the reply, else (for a numeric answer) the reply's last number."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(reply)
    text = (tagged if tagged is not None else reply).strip()
    if NUMBER.fullmatch(expected.strip()) and not NUMBER.fullmatch(text):
        numbers = NUMBER.findall(text)
        return numbers[-1] if numbers else text
    return text


def score(reply: str, label: str) -> float:
    """The task's scorer on one reply; `label` is the JSON the data source wrote."""
    data = json.loads(label)
    entry = data["entry"]
    return float(_scorer(data["task"])(answer_of(reply, str(entry["answer"])), entry) or 0.0)


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict[str, Any]:
    import torch

    replies = [q[len(p):] if q.startswith(p) else q for q, p in zip(queries, prompts)]
    rewards = torch.tensor([score(r, label) for r, label in zip(replies, labels)], dtype=torch.float32)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"reasoning_gym_correct": (rewards >= 1.0).float()}}
