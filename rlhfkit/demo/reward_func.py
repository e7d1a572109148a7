"""Rule-based reward for the demo tasks, in the OpenRLHF `--remote_rm_url reward_func.py` form.

`reward_func(queries, prompts, labels)` gets, for each sample, the full text (prompt + response), the prompt text
and the label (the record's `answer`), and returns 1.0 for an exactly right answer and 0.0 otherwise:

    python -m rlhfkit.cli.train_ppo_ray ... --remote_rm_url examples/reward_func.py --label_key answer

It returns plain lists of floats, not torch tensors as OpenRLHF's examples do (rlhfkit takes both): a reward
worker process imports only what its file imports, and one that imports torch holds about 150 MB more (of the
`--reward_workers` 2 of a run, measured on the tiny GRPO bench, bench/results/ray_startup.md).
"""

from __future__ import annotations

from rlhfkit.demo.tasks import extract_answer, is_correct


def _response(query: str, prompt: str) -> str:
    """The response part of `query`. Decoding can drop special tokens, so fall back to the last prompt match."""
    if query.startswith(prompt):
        return query[len(prompt):]
    at = query.rfind(prompt) if prompt else -1
    return query[at + len(prompt):] if at >= 0 else query


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """1.0 where the response's first line equals the label, else 0.0.

    Returns `rewards` (used for advantages), `scores` (the same 0/1 values, used by dynamic filtering) and
    `extra_logs` with per-sample `exact_match` and `answered` (the response had a non-empty first line).
    """
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(f"reward_func: got {len(queries)} queries, {len(prompts)} prompts and "
                         f"{len(labels)} labels; they must match")
    responses = [_response(q, p) for q, p in zip(queries, prompts)]
    rewards = [float(is_correct(r, str(label))) for r, label in zip(responses, labels)]
    answered = [float(extract_answer(r) != "") for r in responses]
    return {"rewards": rewards, "scores": list(rewards), "extra_logs": {"exact_match": list(rewards),
                                                                         "answered": answered}}
