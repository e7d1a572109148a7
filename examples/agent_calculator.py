"""A tool-using agent: the model may write `<calc>EXPR</calc>`; the environment evaluates EXPR with a safe
arithmetic evaluator (an AST walk over numbers and + - * / // % ** and parentheses, never `eval`) and feeds
`<result>VALUE</result>` back; an action without a tool call is the final answer, rewarded 1.0 when its first
number equals the label (`--label_key answer`), else 0.0.

    python -m rlhfkit.cli.train_ppo_ray ... --agent_func_path examples/agent_calculator.py --label_key answer \\
        --max_steps 4 --generate_max_len 64
"""

from __future__ import annotations

import ast
import operator
import re

from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
SIGNS = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_CHARS, MAX_ABS, MAX_EXPONENT = 200, 10 ** 30, 64


def safe_eval(expr: str) -> int | float:
    """The value of an arithmetic expression; ValueError for anything else (names, calls, huge numbers...)."""
    if len(expr) > MAX_CHARS:
        raise ValueError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression ({e.msg})") from None

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = node.value
        elif isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
            value = SIGNS[type(node.op)](walk(node.operand))
        elif isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent above {MAX_EXPONENT}")
            try:
                value = OPERATORS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
        else:
            raise ValueError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")
        if isinstance(value, complex) or abs(value) > MAX_ABS:
            raise ValueError("result out of range")
        return value

    return walk(tree)


def _format(value: int | float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.tool_calls = 0

    async def step(self, states: dict, **kwargs) -> dict:
        action = states["action_text"]
        calls = CALL.findall(action)
        if calls:
            self.tool_calls += 1
            try:
                result = _format(safe_eval(calls[-1]))
            except ValueError as e:
                result = f"error: {e}"
            return {"rewards": 0.0, "scores": 0.0, "environment_feedback": f"<result>{result}</result>\n",
                    "done": False, "sampling_params": states.get("sampling_params"),
                    "extra_logs": {"tool_calls": self.tool_calls, "correct": 0.0}}
        found = NUMBER.search(action)
        correct = found is not None and str(states["label"]).strip() == found.group(0)
        reward = 1.0 if correct else 0.0
        return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True,
                "sampling_params": states.get("sampling_params"),
                "extra_logs": {"tool_calls": self.tool_calls, "correct": reward}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
