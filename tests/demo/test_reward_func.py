"""examples/reward_func.py: 1.0 for an exactly right answer, 0.0 otherwise, in OpenRLHF's return format (plain
lists: its reward worker processes never import torch)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rlhfkit.demo.tasks import DEMO_INPUT_TEMPLATE

REWARD_FILE = Path(__file__).resolve().parents[2] / "examples" / "reward_func.py"


@pytest.fixture(scope="module")
def reward_func():
    spec = importlib.util.spec_from_file_location("demo_reward_func", REWARD_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward_func


def test_rewards_on_hand_examples(reward_func):
    p = DEMO_INPUT_TEMPLATE.format("What is 12+34?")
    r = DEMO_INPUT_TEMPLATE.format("Reverse the digits of 120.")
    queries = [p + "46", p + " 46\n", p + "46\nand more", p + "460", p + "", r + "021", r + "21",
               "<s>" + p + "46"]  # a decoded query that kept a special token in front
    prompts = [p, p, p, p, p, r, r, p]
    labels = ["46", "46", "46", "46", "46", "021", "021", "46"]
    out = reward_func(queries, prompts, labels)
    expected = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert out["rewards"] == out["scores"] == out["extra_logs"]["exact_match"] == expected
    assert out["extra_logs"]["answered"] == [1.0, 1, 1, 1, 0, 1, 1, 1]
    assert all(type(x) is float for x in out["rewards"])  # plain floats: the worker needs no torch


def test_the_prompt_text_is_not_scored(reward_func):
    # The prompt contains the label ("9"); only the response ("4") is scored.
    p = DEMO_INPUT_TEMPLATE.format("Which is largest: 3, 9, 4?")
    assert reward_func([p + "4"], [p], ["9"])["rewards"] == [0.0]


def test_length_mismatch_is_an_error(reward_func):
    with pytest.raises(ValueError, match="must match"):
        reward_func(["a", "b"], ["a"], ["1", "2"])
