"""Verifiable toy tasks for the offline demo: each makes `(prompt, answer)` pairs and has an exact-match checker.

The answer is the whole response ("168", not "The answer is 168"), so a tiny model learns the format in a few
hundred SFT steps and a rule-based reward can check it with one string comparison.

Tasks (what a ~1M-parameter Llama can partly learn on one CPU core; held-out exact match after 800 SFT steps of
batch 32 on the default mix: addition 0.54, reverse 0.41, max 0.26, count 0.82):
- `addition`: "What is 73+45?" -> "118"; operands uniform below 10**`ADDITION_MAX_DIGITS` (100).
- `reverse`:  "Reverse the digits of 4071." -> "1704"; a number of 3-5 digits.
- `max`:      "Which is largest: 12, 7, 45?" -> "45"; 3-4 numbers below 100.
- `count`:    "How many letters are in qwzt?" -> "4"; a random lowercase word of 2-8 letters.

Every generator takes a `random.Random`, so a seed fixes the whole data set.
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping

TASKS: tuple[str, ...] = ("addition", "reverse", "max", "count")
# The demo's main task is addition; the others keep the data (and the reward) from being one-dimensional.
DEFAULT_TASK_MIX: dict[str, float] = {"addition": 0.7, "reverse": 0.1, "max": 0.1, "count": 0.1}
# Two digits, not three. Measured with plain SFT of the demo Llama on the addition records (AdamW 1e-3,
# cosine): held-out exact match 0.92 after 800 steps of batch 32 and 0.76 after 400 steps of batch 64, but
# 0.21 after 400 of batch 32; with operands of 1-3 digits it was about 0.2 after 800 steps of batch 32.
ADDITION_MAX_DIGITS = 2
EOS_TEXT = "</s>"
# The prompt template of every demo run (`--input_template`): the response follows the trailing space.
DEMO_INPUT_TEMPLATE = "User: {}\nAssistant: "


def _number_with_digits(rng: random.Random, digits: int) -> int:
    """A number with exactly `digits` digits (1 digit includes 0)."""
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _word(rng: random.Random, min_len: int, max_len: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))


def _addition(rng: random.Random) -> tuple[str, str, dict]:
    # Uniform operands, so every prompt is equally likely. (Drawing the digit count first puts a quarter of
    # the mass on the 100 one-digit sums; deduplication then pushes most of them into the eval split.)
    a = rng.randrange(10**ADDITION_MAX_DIGITS)
    b = rng.randrange(10**ADDITION_MAX_DIGITS)
    return f"What is {a}+{b}?", str(a + b), {"operands": [a, b]}


def _reverse(rng: random.Random) -> tuple[str, str, dict]:
    # Digits, not letters: a digit is always one token, while a random word splits into BPE pieces whose
    # spelling a tiny model cannot see (letter reversal stayed at 0% after 800 SFT steps).
    number = str(_number_with_digits(rng, rng.randint(3, 5)))
    return f"Reverse the digits of {number}.", number[::-1], {"number": number}


def _max(rng: random.Random) -> tuple[str, str, dict]:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 4))]
    return f"Which is largest: {', '.join(map(str, numbers))}?", str(max(numbers)), {"numbers": numbers}


def _count(rng: random.Random) -> tuple[str, str, dict]:
    word = _word(rng, 2, 8)
    return f"How many letters are in {word}?", str(len(word)), {"word": word}


_GENERATORS = {"addition": _addition, "reverse": _reverse, "max": _max, "count": _count}


def make_problem(task: str, rng: random.Random) -> dict:
    """One problem of `task`: `{"prompt", "answer", "task"}` (plus the task's inputs under `"inputs"`)."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown demo task {task!r}; one of {', '.join(TASKS)}")
    prompt, answer, inputs = _GENERATORS[task](rng)
    return {"prompt": prompt, "answer": answer, "task": task, "inputs": inputs}


def sample_task(rng: random.Random, mix: Mapping[str, float] | None = None) -> str:
    """Draw a task name with probabilities `mix` (default `DEFAULT_TASK_MIX`)."""
    mix = DEFAULT_TASK_MIX if mix is None else mix
    names = sorted(mix)  # a fixed order, so the draw depends only on the rng state
    return rng.choices(names, weights=[mix[n] for n in names], k=1)[0]


def _wrong_addition(answer: str, inputs: dict, rng: random.Random) -> str:
    a, b = inputs["operands"]
    total = int(answer)
    kind = rng.randrange(4)
    if kind == 0:  # off by a little
        return str(max(0, total + rng.choice([-1, 1]) * rng.randint(1, 9)))
    if kind == 1:  # off by a power of ten: a dropped or invented carry
        return str(abs(total + rng.choice([-1, 1]) * 10 ** rng.randint(1, len(answer))))
    if kind == 2:  # the operands echoed instead of summed
        return f"{a}+{b}"
    digits = list(answer)  # one digit changed
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in string.digits if d != digits[i]])
    return "".join(digits)


def _wrong_reverse(answer: str, inputs: dict, rng: random.Random) -> str:
    if rng.random() < 0.5:
        return inputs["number"]  # copied, not reversed (a palindrome falls through to the next try)
    digits = list(answer)  # one digit changed
    i = rng.randrange(len(digits))
    digits[i] = rng.choice([d for d in string.digits if d != digits[i]])
    return "".join(digits)


def _wrong_max(answer: str, inputs: dict, rng: random.Random) -> str:
    numbers = inputs["numbers"]
    others = [n for n in numbers if str(n) != answer]
    if others and rng.random() < 0.7:
        return str(rng.choice(others))  # a number from the list that is not the largest
    return str(int(answer) + rng.randint(1, 20))


def _wrong_count(answer: str, inputs: dict, rng: random.Random) -> str:
    if rng.random() < 0.2:
        return inputs["word"]  # the word echoed
    return str(max(0, int(answer) + rng.choice([-2, -1, 1, 2])))


_WRONG = {"addition": _wrong_addition, "reverse": _wrong_reverse, "max": _wrong_max, "count": _wrong_count}


def make_wrong_answer(problem: Mapping, rng: random.Random) -> str:
    """A plausible response that breaks the instruction (the `rejected` side of a preference pair).

    Always differs from the right answer after `extract_answer`, so `is_correct` rejects it.
    """
    answer = str(problem["answer"])
    for _ in range(8):
        wrong = _WRONG[problem["task"]](answer, problem["inputs"], rng)
        if wrong and not is_correct(wrong, answer):
            return wrong
    return answer + "0"  # a fallback that is always wrong


def extract_answer(response: str) -> str:
    """The answer part of a model response: text before an eos marker, whitespace stripped, first line."""
    text = response.split(EOS_TEXT, 1)[0].strip()
    return text.splitlines()[0].strip() if text else ""


def is_correct(response: str, answer: str | int) -> bool:
    """Exact match of the extracted answer: `is_correct(" 168\\n", "168")` is True, "1680" is not."""
    return extract_answer(response) == str(answer).strip()
