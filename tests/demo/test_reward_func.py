"""examples/reward_func.py: 1.0 for an exactly right answer, 0.0 otherwise, in OpenRLHF's return format."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

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
    expected = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    assert torch.equal(out["rewards"], expected)
    assert torch.equal(out["scores"], expected)
    assert torch.equal(out["extra_logs"]["exact_match"], expected)
    assert torch.equal(out["extra_logs"]["answered"], torch.tensor([1.0, 1, 1, 1, 0, 1, 1, 1]))
    assert out["rewards"].dtype == torch.float32


def test_the_prompt_text_is_not_scored(reward_func):
    # The prompt contains the label ("9"); only the response ("4") is scored.
    p = DEMO_INPUT_TEMPLATE.format("Which is largest: 3, 9, 4?")
    assert reward_func([p + "4"], [p], ["9"])["rewards"].tolist() == [0.0]


def test_length_mismatch_is_an_error(reward_func):
    with pytest.raises(ValueError, match="must match"):
        reward_func(["a", "b"], ["a"], ["1", "2"])
