"""A multi-tool environment: the model gets a `calculator` and a `python` tool through its chat template, calls
them in its own tool format (Hermes/Qwen `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`; --tool_format or
detected from the template), reads the results as `tool` messages, and its final answer (a turn without a tool
call) is rewarded 1.0 when its first number equals the label (`--label_key answer`), else 0.0.

`python` runs the model's code in rlhfkit's sandbox (rlhfkit/rewards/sandbox.py: bubblewrap namespaces, no network,
a read-only root, a seccomp filter, CPU / memory / process limits, a wall-clock timeout) and returns what it
printed. Without bubblewrap the file refuses to load (one line), unless RLHFKIT_UNSAFE_CODE_EXECUTION=1 accepts the
risk. The environment itself runs in the agent worker pool with --reward_timeout per reset / step.

    python -m rlhfkit.cli.train_ppo_ray ... --agent_func_path examples/env_multi_tool.py --label_key answer \\
        --max_steps 4 --generate_max_len 128
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from rlhfkit.agents import Action, Environment, Step
from rlhfkit.rewards.sandbox import SandboxLimits, isolation, run_python

# The safe arithmetic evaluator of examples/agent_calculator.py (an AST walk, never `eval`).
_spec = importlib.util.spec_from_file_location("agent_calculator", Path(__file__).with_name("agent_calculator.py"))
assert _spec is not None and _spec.loader is not None
_calculator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_calculator)

ISOLATION = isolation()  # here, at import: a machine that cannot sandbox code stops the run before it starts
LIMITS = SandboxLimits(wall_seconds=5.0, cpu_seconds=2, memory_bytes=512 << 20, processes=8)
MAX_OUTPUT = 500  # characters of a program's output the model reads back
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).

    Args:
        expression: the expression to evaluate, e.g. "12*34".
    """
    value = _calculator.safe_eval(expression)  # a ValueError reaches the model as the call's error message
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed.

    Args:
        code: the program, e.g. "print(sum(range(10)))".
    """
    result = run_python(code, LIMITS)
    if result.status == "timeout":
        return f"error: the program ran past {LIMITS.wall_seconds:g} s"
    if not result.passed:
        lines = result.stderr.strip().splitlines()
        return f"error: {lines[-1] if lines else f'exit status {result.returncode}'}"[:MAX_OUTPUT]
    return result.stdout[:MAX_OUTPUT]


def first_number(text: str) -> str | None:
    found = NUMBER.search(text)
    return None if found is None else found.group(0)


class MultiToolEnvironment(Environment):
    tools = [calculator, python]

    def reset(self, prompt: str, label: object) -> str:
        self.label = str(label).strip()
        self.calls = 0
        return prompt  # the user message; the chat template renders it with the tools

    def step(self, action: Action) -> Step:
        if action.tool_calls or action.call_errors:
            self.calls += len(action.tool_calls)
            return Step(self.call_tools(action), 0.0, False, {"correct": 0.0})
        correct = float(first_number(action.content) == self.label)
        return Step("", correct, True, {"correct": correct, "calls_before_answer": float(self.calls)})
