"""Record builders for the demo data sets: SFT, preference pairs, unpaired KTO and RL prompts.

Schemas (one JSON object per line):
- SFT: `{"question", "response", "task", "messages": [user, assistant]}`
- preference: `{"prompt", "chosen", "rejected", "task", "chosen_messages", "rejected_messages"}`; `chosen` is
  the right answer, `rejected` a plausible wrong one (`tasks.make_wrong_answer`).
- KTO: `{"prompt", "completion", "label", "task"}`, both sides of each preference pair, shuffled.
- RL: `{"prompt", "answer", "task"}`; the label key is `answer`.

Prompts are unique within each split; eval splits are disjoint from each other and from every train split.
Train splits may share prompts with each other (RL prompts the SFT stage saw are normal), which keeps the
small addition space (100 x 100 sums) from running out.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from rlhfkit.demo import tasks

MAX_DRAWS_PER_PROBLEM = 1000


def draw_unique_problems(n: int, rng: random.Random, used: set[str],
                         mix: Mapping[str, float] | None = None) -> list[dict]:
    """`n` problems whose prompts are not in `used` (and get added to it), tasks drawn from `mix`."""
    out: list[dict] = []
    for _ in range(n):
        # Redraw within the same task on a repeat: redrawing the task too would skew the mix away from the
        # task with the smallest prompt space (addition).
        task = tasks.sample_task(rng, mix)
        for _ in range(MAX_DRAWS_PER_PROBLEM):
            problem = tasks.make_problem(task, rng)
            if problem["prompt"] not in used:
                break
        else:
            raise ValueError(f"demo data: ran out of distinct {task} prompts after {len(out)} of {n}; "
                             "ask for fewer records")
        used.add(problem["prompt"])
        out.append(problem)
    return out


def _chat(prompt: str, response: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def sft_record(problem: Mapping) -> dict:
    return {"question": problem["prompt"], "response": problem["answer"], "task": problem["task"],
            "messages": _chat(problem["prompt"], problem["answer"])}


def preference_record(problem: Mapping, rng: random.Random) -> dict:
    rejected = tasks.make_wrong_answer(problem, rng)
    return {"prompt": problem["prompt"], "chosen": problem["answer"], "rejected": rejected,
            "task": problem["task"], "chosen_messages": _chat(problem["prompt"], problem["answer"]),
            "rejected_messages": _chat(problem["prompt"], rejected)}


def kto_records(pairs: list[dict], rng: random.Random) -> list[dict]:
    """Unpaired KTO data from preference pairs: the chosen side labelled true, the rejected side false."""
    records = []
    for pair in pairs:
        records.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True,
                        "task": pair["task"]})
        records.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False,
                        "task": pair["task"]})
    rng.shuffle(records)
    return records


def rl_record(problem: Mapping) -> dict:
    return {"prompt": problem["prompt"], "answer": problem["answer"], "task": problem["task"]}


def build_all_records(seed: int, sizes: Mapping[str, int],
                      mix: Mapping[str, float] | None = None) -> dict[str, list[dict]]:
    """Every demo split, keyed by file stem (`sft_train`, ..., `rl_eval`). Deterministic in `seed`.

    `sizes` holds `sft_train`, `sft_eval`, `pref_train`, `pref_eval`, `rl_train`, `rl_eval`. Each split has its
    own rng and eval splits are drawn first, so growing a train split changes neither the eval sets nor the
    other train splits.
    """
    eval_prompts: set[str] = set()

    def draw(split: str, used: set[str]) -> list[dict]:
        rng = random.Random(f"rlhfkit-demo-{seed}-{split}")  # str seeds hash with sha512: stable across runs
        return draw_unique_problems(sizes[split], rng, used, mix)

    problems = {split: draw(split, eval_prompts) for split in ("sft_eval", "rl_eval", "pref_eval")}
    for split in ("sft_train", "pref_train", "rl_train"):
        problems[split] = draw(split, set(eval_prompts))
    pair_rng = random.Random(f"rlhfkit-demo-{seed}-pairs")
    pref_train = [preference_record(p, pair_rng) for p in problems["pref_train"]]
    pref_eval = [preference_record(p, pair_rng) for p in problems["pref_eval"]]
    kto_rng = random.Random(f"rlhfkit-demo-{seed}-kto")
    return {
        "sft_train": [sft_record(p) for p in problems["sft_train"]],
        "sft_eval": [sft_record(p) for p in problems["sft_eval"]],
        "pref_train": pref_train,
        "pref_eval": pref_eval,
        "kto_train": kto_records(pref_train, kto_rng),
        "kto_eval": kto_records(pref_eval, kto_rng),
        "rl_train": [rl_record(p) for p in problems["rl_train"]],
        "rl_eval": [rl_record(p) for p in problems["rl_eval"]],
    }
