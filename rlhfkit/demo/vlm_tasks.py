"""Synthetic image tasks for the tiny vision-language model: drawn on the spot with PIL from a seed, checked by exact
match (the demo's rule-based reward, `rlhfkit.demo.reward_func`, scores them unchanged: the label is the answer).

Tasks (every image `IMAGE_SIZE` x `IMAGE_SIZE` pixels, so 4 vision tokens for the tiny Qwen2-VL's 14-pixel patches
merged 2 x 2):
- `dots`:   "How many dots are there?" -> "3"; 1 to 5 black dots on white.
- `colour`: "Which colour is the square?" -> "red"; one filled square in one of `COLOURS`.
- `digit`:  "Which digit is shown?" -> "7"; one digit drawn as seven segments (no font files needed).

Every generator takes a `random.Random`, so a seed fixes the images and the data set.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

IMAGE_SIZE = 56
VLM_TASKS: tuple[str, ...] = ("dots", "colour", "digit")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220), "yellow": (235, 205, 20)}
# Segments a..g of a seven-segment digit (a top, b top right, c bottom right, d bottom, e bottom left, f top left,
# g middle).
_SEGMENTS = {"0": "abcdef", "1": "bc", "2": "abged", "3": "abgcd", "4": "fgbc", "5": "afgcd", "6": "afgedc",
             "7": "abc", "8": "abcdefg", "9": "abcdfg"}


def _canvas() -> Any:
    from PIL import Image

    return Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))


def _dots(rng: random.Random) -> tuple[Any, str, str]:
    from PIL import ImageDraw

    n = rng.randint(1, 5)
    image = _canvas()
    draw = ImageDraw.Draw(image)
    centres: list[tuple[int, int]] = []
    while len(centres) < n:  # far enough apart that dots never touch
        c = (rng.randint(6, IMAGE_SIZE - 7), rng.randint(6, IMAGE_SIZE - 7))
        if all(abs(c[0] - x) + abs(c[1] - y) > 14 for x, y in centres):
            centres.append(c)
    for x, y in centres:
        draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=(0, 0, 0))
    return image, "How many dots are there?", str(n)


def _colour(rng: random.Random) -> tuple[Any, str, str]:
    from PIL import ImageDraw

    name = rng.choice(sorted(COLOURS))
    side = rng.randint(16, 30)
    x, y = rng.randint(0, IMAGE_SIZE - side), rng.randint(0, IMAGE_SIZE - side)
    image = _canvas()
    ImageDraw.Draw(image).rectangle((x, y, x + side, y + side), fill=COLOURS[name])
    return image, "Which colour is the square?", name


def _digit(rng: random.Random) -> tuple[Any, str, str]:
    from PIL import ImageDraw

    digit = str(rng.randint(0, 9))
    w, h, t = rng.randint(16, 24), rng.randint(30, 40), 4  # width, height, stroke
    x0, y0 = rng.randint(2, IMAGE_SIZE - w - 3), rng.randint(2, IMAGE_SIZE - h - 3)
    mid = y0 + h // 2
    boxes = {"a": (x0, y0, x0 + w, y0 + t), "g": (x0, mid - t // 2, x0 + w, mid + t // 2),
             "d": (x0, y0 + h - t, x0 + w, y0 + h), "f": (x0, y0, x0 + t, mid), "b": (x0 + w - t, y0, x0 + w, mid),
             "e": (x0, mid, x0 + t, y0 + h), "c": (x0 + w - t, mid, x0 + w, y0 + h)}
    image = _canvas()
    draw = ImageDraw.Draw(image)
    for segment in _SEGMENTS[digit]:
        draw.rectangle(boxes[segment], fill=(0, 0, 0))
    return image, "Which digit is shown?", digit


_GENERATORS: dict[str, Callable[[random.Random], tuple[Any, str, str]]] = {
    "dots": _dots, "colour": _colour, "digit": _digit}


def make_image_problem(task: str, rng: random.Random) -> dict:
    """One problem: {"image": PIL image, "prompt", "answer", "task"}."""
    if task not in _GENERATORS:
        raise ValueError(f"unknown image task {task!r}; one of {', '.join(VLM_TASKS)}")
    image, prompt, answer = _GENERATORS[task](rng)
    return {"image": image, "prompt": prompt, "answer": answer, "task": task}


def wrong_image_answer(problem: dict, rng: random.Random) -> str:
    """A plausible wrong answer of the same kind (the rejected side of a preference pair)."""
    answer, task = problem["answer"], problem["task"]
    if task == "colour":
        return rng.choice([c for c in sorted(COLOURS) if c != answer])
    choices = [str(d) for d in (range(1, 6) if task == "dots" else range(10)) if str(d) != answer]
    return rng.choice(choices)
