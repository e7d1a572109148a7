"""A stateful text game: guess the number. The label (`--label_key answer`) is the secret; each turn the model
names a number and the environment answers "Higher." or "Lower." until it is found or `MAX_GUESSES` are used.
Reward 1.0 for finding it, less 0.1 per extra guess; 0.0 when it is not found. A turn without a number costs a
guess and reads "Answer with a number.". Text mode: the prompt and the answers are appended as they are (no tools,
no chat template).

    python -m rlhfkit.cli.train_ppo_ray ... --agent_func_path examples/env_guess_number.py --label_key answer \\
        --max_steps 6 --generate_max_len 96
"""

from __future__ import annotations

import re

from rlhfkit.agents import Action, Environment, Step

MAX_GUESSES = 6
NUMBER = re.compile(r"-?\d+")


class GuessTheNumber(Environment):
    def reset(self, prompt: str, label: object) -> str:
        self.secret = int(str(label).strip())
        self.guesses = 0
        return prompt

    def step(self, action: Action) -> Step:
        self.guesses += 1
        found = NUMBER.search(action.text)
        info = {"guesses": float(self.guesses)}
        if found is not None and int(found.group(0)) == self.secret:
            return Step("", max(1.0 - 0.1 * (self.guesses - 1), 0.1), True, {**info, "found": 1.0})
        if self.guesses >= MAX_GUESSES:
            return Step("", 0.0, True, {**info, "found": 0.0})
        if found is None:
            hint = "Answer with a number."
        else:
            hint = "Higher." if int(found.group(0)) < self.secret else "Lower."
        return Step(f"\n{hint}\n", 0.0, False, {**info, "found": 0.0})
