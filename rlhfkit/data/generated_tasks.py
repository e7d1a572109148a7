"""Prompts drawn on the spot from a task generator: `reasoning_gym:<task>[?key=value&...]` as a data source.

reasoning-gym (PyPI `reasoning-gym`, Apache-2.0) generates problems procedurally, offline, each with its answer and
a scorer: GSM8K-style word problems (`gsm_symbolic`), arithmetic, countdown, puzzles (about a hundred tasks). Give a
task as a data source anywhere a dataset is taken (`--prompt_data`, `--eval_dataset`, mixtures):

    --prompt_data reasoning_gym:gsm_symbolic?size=2000&seed=1 --input_key prompt --label_key label
    --eval_dataset reasoning_gym:gsm_symbolic@test

Each record is `{"prompt": question, "answer": answer, "label": JSON of the task and its entry}`; the label is what
the packaged reward (`--remote_rm_url reasoning_gym`, rewards/reasoning_gym_reward.py) scores a reply against with
the task's own scorer, so no per-task code is needed. Query keys: `size` (records, default 1000), `seed` (default 1)
and any field of the task's config (e.g. `min_terms=2`), passed through as numbers where they parse as numbers.

Splits, by a hash partition of the question text: a question is held out when the SHA-256 of its text falls in the
first fifth of the hash range (`HELD_OUT_SHARE`). `train` is the first `size` problems of the generator's stream for
`seed` whose question is not held out; `test` (also `eval`, `validation`) the first `size` whose question is. The
partition depends on the question alone, so no `@test` draw ever shares a question with any `@train` draw of the
task, whatever the sizes, seeds or settings of either, and a spec always gives the same records. (Disjoint seed
streams would not do: tasks with few distinct questions repeat them across seeds, e.g. small sums.)
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from typing import Any
from urllib.parse import parse_qsl

from rlhfkit.errors import UserError

PREFIX = "reasoning_gym:"
HELD_OUT = ("test", "eval", "validation", "valid", "dev")
HELD_OUT_SHARE = 0.2  # the share of the question space held out: an 80/20 split of every task
MAX_DRAWS_PER_RECORD = 64  # a split stops looking after this many generator problems per record asked for


def is_generated(spec: str) -> bool:
    return spec.startswith(PREFIX)


def _number(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str, arg_name: str) -> tuple[str, dict[str, Any]]:
    """`reasoning_gym:task?size=10&seed=2` -> ("task", {"size": 10, "seed": 2})."""
    task, _, query = spec[len(PREFIX):].partition("?")
    if not task:
        raise UserError(f"{arg_name} {spec}: names no task; write reasoning_gym:<task>, e.g. "
                        "reasoning_gym:gsm_symbolic")
    pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=False) if query else []
    if query and not pairs:
        raise UserError(f"{arg_name} {spec}: {query!r} is not key=value pairs joined by &")
    options = {key: _number(value) for key, value in pairs}
    for key in ("size", "seed"):
        if key in options and (not isinstance(options[key], int) or options[key] < (1 if key == "size" else 0)):
            kind = "positive" if key == "size" else "non-negative"
            raise UserError(f"{arg_name} {spec}: {key}={options[key]} must be a {kind} integer")
    return task, options


def _reasoning_gym(arg_name: str) -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise UserError(f"{arg_name}: reasoning_gym: tasks need the reasoning-gym package; install it with "
                        "`pip install reasoning-gym` (it is in rlhfkit's [dev] extra)") from None
    return reasoning_gym


def _draw(rg: Any, task: str, options: dict[str, Any], seed: int, spec: str, arg_name: str) -> list[dict]:
    """The generator's first `options["size"]` problems for `seed`, in its order."""
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"there are {len(DATASETS)} tasks, e.g. gsm_symbolic"
        raise UserError(f"{arg_name} {spec}: reasoning-gym has no task {task!r}; {hint}")
    config = {k: v for k, v in options.items() if k != "seed"}
    try:
        dataset = rg.create_dataset(task, seed=seed, **config)
        return [dataset[i] for i in range(len(dataset))]
    except (TypeError, ValueError, AssertionError) as e:  # an unknown or out-of-range config field
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{arg_name} {spec}: reasoning-gym refused the task's settings: {first}") from None


def is_held_out(question: str) -> bool:
    """Whether `question` belongs to the held-out side of the partition: a pure function of its text."""
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < HELD_OUT_SHARE * 2**64


def _draw_split(rg: Any, task: str, options: dict[str, Any], held_out: bool, spec: str,
                arg_name: str) -> list[dict]:
    """The first `size` problems of the seed's stream on the `held_out` side; the stream is drawn long enough to
    hold them (doubling when the first guess falls short), up to `MAX_DRAWS_PER_RECORD` problems per record."""
    size, seed = int(options.get("size", 1000)), int(options.get("seed", 1))
    share = HELD_OUT_SHARE if held_out else 1 - HELD_OUT_SHARE
    n, limit = math.ceil(size / share * 1.25) + 16, size * MAX_DRAWS_PER_RECORD
    while True:
        drawn = _draw(rg, task, {**options, "size": n}, seed, spec, arg_name)
        kept = [e for e in drawn if is_held_out(e["question"]) == held_out][:size]
        if len(kept) == size or n >= limit:
            break
        n = min(2 * n, limit)
    if not kept:
        side = "held-out" if held_out else "training"
        raise UserError(f"{arg_name} {spec}: none of the task's first {n} problems falls on the {side} side of "
                        "the question partition; the task has too few distinct questions for a held-out split")
    return kept


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def generated_records(spec: str, split: str, arg_name: str = "--dataset") -> list[dict[str, Any]]:
    """The records of `reasoning_gym:<task>?...` for `split` (module docstring)."""
    task, options = parse_spec(spec, arg_name)
    rg = _reasoning_gym(arg_name)
    if split != "train" and split not in HELD_OUT:
        raise UserError(f"{arg_name} {spec}@{split}: a generated task has the splits train and test")
    entries = _draw_split(rg, task, options, split in HELD_OUT, spec, arg_name)
    records = []
    for entry in entries:
        entry = _jsonable(entry)
        label = json.dumps({"task": entry.get("metadata", {}).get("source_dataset", task), "entry": entry})
        records.append({"prompt": entry["question"], "answer": str(entry["answer"]), "label": label})
    return records
