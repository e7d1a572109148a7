"""A native tool-calling agent: the model gets a `calculator` tool through its chat template, calls it in its own
tool format (Hermes/Qwen `<tool_call>`, Llama 3 JSON or Mistral `[TOOL_CALLS]`, detected from the template or set
with --tool_format), reads the result as a `tool` message, and its final answer (a turn without a tool call) is
rewarded 1.0 when its first number equals the label (`--label_key answer`), else 0.0.

The prompts are plain user text (no --apply_chat_template): the agent renders them with the tools. The model's
chat template must render tools and `tool` messages (Qwen 2.5/3, Llama 3.1+, Mistral's do).

    python -m rlhfkit.cli.train_ppo_ray ... --agent_func_path examples/agent_tools.py --label_key answer \\
        --max_steps 4 --generate_max_len 128

The calculator runs in the user-code worker pool with --reward_timeout: a call that fails or hangs costs that
call (the model reads an error), and `extra_logs` count calls, malformed calls and failures.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from rlhfkit.agents import ToolAgent, ToolAgentExecutor

# The safe arithmetic evaluator of examples/agent_calculator.py (an AST walk, never `eval`).
_spec = importlib.util.spec_from_file_location("agent_calculator", Path(__file__).with_name("agent_calculator.py"))
assert _spec is not None and _spec.loader is not None
_calculator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_calculator)

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).

    Args:
        expression: the expression to evaluate, e.g. "12*34".
    """
    value = _calculator.safe_eval(expression)  # a ValueError reaches the model as the call's error message
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class AgentInstance(ToolAgent):
    tools = [calculator]

    def final_reward(self, answer: str, label: object) -> float:
        found = NUMBER.search(answer)
        return 1.0 if found is not None and found.group(0) == str(label).strip() else 0.0


class AgentExecutor(ToolAgentExecutor):
    def __init__(self) -> None:
        super().__init__(AgentInstance)
