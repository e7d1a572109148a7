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

Splits: `train` draws with `seed`; `test` (also `eval`, `validation`) draws with another seed and drops every
question the train split of the same size holds, so a held-out split never shares a problem with training.
"""

from __future__ import annotations

import difflib
import json
from typing import Any
from urllib.parse import parse_qsl

from rlhfkit.errors import UserError

PREFIX = "reasoning_gym:"
HELD_OUT = ("test", "eval", "validation", "valid", "dev")
HELD_OUT_SEED_OFFSET = 1_000_003  # the held-out split's seed: the train seed plus this


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
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else f"there are {len(DATASETS)} tasks, e.g. gsm_symbolic"
        raise UserError(f"{arg_name} {spec}: reasoning-gym has no task {task!r}; {hint}")
    config = {k: v for k, v in options.items() if k != "seed"}
    config.setdefault("size", 1000)
    try:
        dataset = rg.create_dataset(task, seed=seed, **config)
        return [dataset[i] for i in range(len(dataset))]
    except (TypeError, ValueError, AssertionError) as e:  # an unknown or out-of-range config field
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{arg_name} {spec}: reasoning-gym refused the task's settings: {first}") from None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def generated_records(spec: str, split: str, arg_name: str = "--dataset") -> list[dict[str, Any]]:
    """The records of `reasoning_gym:<task>?...` for `split` (module docstring)."""
    task, options = parse_spec(spec, arg_name)
    rg = _reasoning_gym(arg_name)
    seed = int(options.get("seed", 1))
    if split == "train":
        entries = _draw(rg, task, options, seed, spec, arg_name)
    elif split in HELD_OUT:
        seen = {e["question"] for e in _draw(rg, task, options, seed, spec, arg_name)}
        entries = [e for e in _draw(rg, task, options, seed + HELD_OUT_SEED_OFFSET, spec, arg_name)
                   if e["question"] not in seen]
    else:
        raise UserError(f"{arg_name} {spec}@{split}: a generated task has the splits train and test")
    records = []
    for entry in entries:
        entry = _jsonable(entry)
        label = json.dumps({"task": entry.get("metadata", {}).get("source_dataset", task), "entry": entry})
        records.append({"prompt": entry["question"], "answer": str(entry["answer"]), "label": label})
    return records
