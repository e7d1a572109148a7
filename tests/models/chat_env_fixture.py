"""A two-question chat environment for the real-model agent test (tests/models/test_real_model.py).

Chat mode without tools (`reset` returns messages): every turn goes through the model's own chat template. The
first turn is asked the prompt's sum; the feedback is a user message with a second sum; the episode ends after the
second answer, rewarded 1 per right answer.
"""

from __future__ import annotations

import re

from rlhfkit.agents import Action, Environment, Step

FOLLOW_UP = "Now add 10 to that number. Reply with the number only."


def first_number(text: str) -> int | None:
    found = re.search(r"-?\d+", text)
    return int(found.group()) if found else None


class TwoSums(Environment):
    def reset(self, prompt: str, label) -> list[dict]:
        self.answer, self.turn = int(label), 0
        return [{"role": "user", "content": prompt}]

    def step(self, action: Action) -> Step:
        self.turn += 1
        right = float(first_number(action.text) == self.answer)
        if self.turn == 1:
            self.answer += 10
            return Step(FOLLOW_UP, right, False, {"turn": 1})
        return Step("", right, True, {"turn": 2})
