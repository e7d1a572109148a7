"""The demo tasks: generators give right answers, the checker matches exactly, wrong answers are wrong."""

from __future__ import annotations

import random
import re

import pytest

from rlhfkit.demo import tasks


@pytest.mark.parametrize("response, answer, expected", [
    (" 168\n", "168", True),
    ("168", 168, True),
    ("168</s>", "168", True),
    ("168\n169", "168", True),  # only the first line counts
    ("\n\n168 \n", "168", True),
    ("1680", "168", False),
    ("16 8", "168", False),
    ("", "168", False),
    ("The answer is 168", "168", False),
    ("0321", "0321", True),
    ("321", "0321", False),
])
def test_is_correct_on_hand_examples(response, answer, expected):
    assert tasks.is_correct(response, answer) is expected


def test_extract_answer_takes_the_stripped_first_line():
    assert tasks.extract_answer("  42 \n7") == "42"
    assert tasks.extract_answer("abc</s>\nxyz") == "abc"
    assert tasks.extract_answer("   \n ") == ""


def _recompute(problem: dict) -> str:
    """An independent solver that reads only the prompt text."""
    prompt = problem["prompt"]
    if problem["task"] == "addition":
        a, b = re.fullmatch(r"What is (\d+)\+(\d+)\?", prompt).groups()
        return str(int(a) + int(b))
    if problem["task"] == "reverse":
        return re.fullmatch(r"Reverse the digits of (\d+)\.", prompt).group(1)[::-1]
    if problem["task"] == "max":
        numbers = re.fullmatch(r"Which is largest: ([\d, ]+)\?", prompt).group(1).split(", ")
        return str(max(int(n) for n in numbers))
    return str(len(re.fullmatch(r"How many letters are in ([a-z]+)\?", prompt).group(1)))


@pytest.mark.parametrize("task", tasks.TASKS)
def test_generated_answers_are_right_and_short(task):
    rng = random.Random(1)
    for _ in range(300):
        problem = tasks.make_problem(task, rng)
        assert problem["task"] == task
        assert problem["answer"] == _recompute(problem)
        assert tasks.is_correct(problem["answer"], problem["answer"])
        assert "\n" not in problem["answer"] and len(problem["answer"]) <= 5


def test_addition_operands_are_uniform_below_the_digit_limit():
    rng = random.Random(2)
    operands = [n for _ in range(5000) for n in tasks.make_problem("addition", rng)["inputs"]["operands"]]
    limit = 10**tasks.ADDITION_MAX_DIGITS
    assert min(operands) == 0 and max(operands) == limit - 1
    one_digit = sum(n < 10 for n in operands) / len(operands)
    assert abs(one_digit - 10 / limit) < 0.02


def test_same_rng_state_gives_same_problems():
    first = [tasks.make_problem(t, random.Random(7)) for t in tasks.TASKS]
    second = [tasks.make_problem(t, random.Random(7)) for t in tasks.TASKS]
    assert first == second


@pytest.mark.parametrize("task", tasks.TASKS)
def test_wrong_answers_are_never_correct(task):
    rng = random.Random(3)
    for _ in range(300):
        problem = tasks.make_problem(task, rng)
        wrong = tasks.make_wrong_answer(problem, rng)
        assert wrong and not tasks.is_correct(wrong, problem["answer"])


def test_wrong_answer_for_a_palindrome_still_differs():
    problem = {"prompt": "Reverse the digits of 383.", "answer": "383", "task": "reverse",
               "inputs": {"number": "383"}}
    rng = random.Random(0)
    assert all(tasks.make_wrong_answer(problem, rng) != "383" for _ in range(50))


def test_sample_task_follows_the_mix():
    rng = random.Random(4)
    draws = [tasks.sample_task(rng) for _ in range(5000)]
    assert abs(draws.count("addition") / 5000 - 0.7) < 0.03
    assert set(draws) == set(tasks.TASKS)
    assert {tasks.sample_task(rng, {"max": 1.0}) for _ in range(20)} == {"max"}


def test_unknown_task_is_rejected():
    with pytest.raises(ValueError, match="unknown demo task"):
        tasks.make_problem("division", random.Random(0))
