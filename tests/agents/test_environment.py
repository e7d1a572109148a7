"""The gym-style environment interface (rlhfkit.agents.environment) and its adapter onto the agent API
(rlhfkit.agents.env_agent): type checks of what reset / step return, tool calls run by `call_tools`, the loader of
environment files, and episodes in text mode and in chat mode (tools through the chat template), in-process and in
the agent worker pool; an environment returning the wrong types costs its episode, counted by kind."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from rlhfkit.agents import Action, Environment, Step
from rlhfkit.agents.api import AgentFailure
from rlhfkit.agents.env_agent import EnvironmentExecutor, environment_executor
from rlhfkit.agents.environment import check_reset, check_step
from rlhfkit.agents.episodes import episodes_to_samples, load_agent_executor, run_episodes
from rlhfkit.agents.tool_parsers import ToolCall
from rlhfkit.errors import UserError
from rlhfkit.rollout.engine import FINISH_STOP, SampledSequence

HERMES = Path(__file__).resolve().parent / "tool_templates" / "hermes.jinja"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


class Adder(Environment):
    tools = [add]


@pytest.mark.parametrize("value, info", [
    (Step("ok", 1, False, {"n": 2}), {"n": 2.0}),
    (("ok", 1, False, {"n": 2}), {"n": 2.0}),
    (("ok", np.float32(1.0), np.bool_(False), {"n": True}), {"n": 1.0}),  # numpy scalars, as gym envs return
    (("ok", 1.0, False, None), {}),
])
def test_a_step_or_a_four_tuple_is_taken(value, info):
    step = check_step(value)
    assert step.observation == "ok" and step.reward == 1.0 and step.done is False and step.info == info


@pytest.mark.parametrize("value, kind, message", [
    ({"reward": 1}, "bad_output", "step returned dict, not a Step"),
    (("ok", 1.0, False), "bad_output", "step returned tuple"),
    (("ok", "1", False, {}), "bad_output", "reward is str, not a number"),
    (("ok", True, False, {}), "bad_output", "reward is bool"),
    (("ok", math.nan, False, {}), "non_finite", "reward is nan"),
    (("ok", 1.0, 1, {}), "bad_output", "done is int, not a bool"),
    (("ok", 1.0, False, {"a": "x"}), "bad_output", "info is not a dict of numbers"),
    ((3, 1.0, False, {}), "bad_output", "observation is int"),
    (([{"role": "robot", "content": "x"}], 1.0, False, {}), "bad_output", "not a message"),
    (([], 1.0, False, {}), "bad_output", "non-empty list"),
])
def test_wrong_types_from_step_are_the_environments_failure(value, kind, message):
    with pytest.raises(AgentFailure, match=message) as info:
        check_step(value)
    assert info.value.kind == kind


def test_reset_returns_text_or_messages():
    assert check_reset("hi") == "hi"
    assert check_reset([{"role": "user", "content": "hi"}]) == [{"role": "user", "content": "hi"}]
    with pytest.raises(AgentFailure, match="reset's observation is NoneType"):
        check_reset(None)
    assert check_step(("", 1.0, True, {})).observation == ""  # a final step needs no observation


def test_call_tools_answers_each_call_and_bad_calls_cost_only_that_call():
    action = Action(text="...", tool_calls=[ToolCall("add", {"a": 2, "b": 3}), ToolCall("mul", {"a": 1}),
                                            ToolCall("add", {"a": "x", "b": 1})], call_errors=["not JSON"])
    out = Adder().call_tools(action)
    assert [m["content"] for m in out] == ["error: not JSON", "5", "error: unknown tool 'mul' (tools: add)",
                                           "error: 'x' is not of type 'integer'"]
    assert all(m["role"] == "tool" for m in out)


def test_a_tool_that_raises_costs_its_call():
    def boom(x: int) -> int:
        raise ValueError("no")

    class Env(Environment):
        tools = [boom]

    [m] = Env().call_tools(Action(text="", tool_calls=[ToolCall("boom", {"x": 1})]))
    assert m["content"] == "error: tool boom raised ValueError: no"


class FakeModule:
    def __init__(self, name: str, **values):
        self.__name__ = name
        self.__dict__.update(values)


def test_the_loader_makes_an_executor_for_the_files_one_environment():
    env = type("Game", (Environment,), {"__module__": "m"})
    cls = environment_executor(FakeModule("m", Game=env, Environment=Environment), "env.py")
    assert issubclass(cls, EnvironmentExecutor) and cls.environment_cls is env
    assert environment_executor(FakeModule("m", x=1), "env.py") is None
    other = type("Other", (Environment,), {"__module__": "m"})
    with pytest.raises(UserError, match="defines 2 Environment classes"):
        environment_executor(FakeModule("m", Game=env, Other=other), "env.py")


def untyped(x):
    return x


@pytest.mark.parametrize("tools, message", [
    ([untyped], "environment Bad: tool untyped: parameter 'x' has no type hint"),
    ([add, add], "tools: names must be unique"),
])
def test_a_bad_tool_declaration_of_an_environment_is_one_line_at_load(tools, message):
    bad = type("Bad", (Environment,), {"__module__": "m", "tools": tools})
    with pytest.raises(UserError, match=message) as info:
        environment_executor(FakeModule("m", Bad=bad), "env.py")
    assert "\n" not in str(info.value)


class Scripted:
    """An engine whose turns are given texts (each ending with eos), with made-up log-probs."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.contexts = tok, list(turns), []

    def __call__(self, prompt_ids, *, max_new_tokens, seed=None, **sampling):
        out = []
        for ids in prompt_ids:
            response = self.tok.encode(self.turns.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
            self.contexts.append(list(ids))
            out.append(SampledSequence(list(ids), response, [-0.5] * len(response), FINISH_STOP))
        return out


@pytest.fixture(scope="module")
def tok(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets.model_dir)


def request(tok, prompt: str, label: str) -> dict:
    return {"prompt": prompt, "prompt_ids": [tok.bos_token_id] + tok.encode(prompt, add_special_tokens=False),
            "label": label}


GAME = Path(__file__).resolve().parents[2] / "examples" / "env_guess_number.py"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_text_environment_runs_as_an_agent_with_exact_tokens(tok, workers):
    prompt = "Guess my number.\n"
    engine = Scripted(tok, ["50", "20", "30"])
    [ep] = run_episodes(engine, tok, str(GAME), [request(tok, prompt, "30")], max_steps=6, max_length=200, seed=0,
                        step_timeout=20, agent_workers=workers, **SAMPLING)
    assert ep["finish"] == "done" and ep["turns"] == 3 and ep["reward"] == pytest.approx(0.8)
    assert ep["extra_logs"] == {"guesses": 3.0, "found": 1.0}
    eos = tok.eos_token_id
    lower, higher = (tok.encode(t, add_special_tokens=False) for t in ("\nLower.\n", "\nHigher.\n"))
    guess = [tok.encode(t, add_special_tokens=False) + [eos] for t in ("50", "20", "30")]
    assert ep["prompt_ids"] == request(tok, prompt, "30")["prompt_ids"]
    assert ep["response_ids"] == guess[0] + lower + guess[1] + higher + guess[2]
    assert ep["action_mask"] == [1] * len(guess[0]) + [0] * len(lower) + [1] * len(guess[1]) + \
        [0] * len(higher) + [1] * len(guess[2])


GAME_WITH = {
    "example": """from openrlhf.utils.agent import AgentExecutorBase

class AgentExecutor(AgentExecutorBase):
    def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):
        super().__init__(GuessTheNumber, max_steps, max_length, llm_engine, hf_tokenizer, result_queue)
""",
    "0.11": """from openrlhf.utils.agent import MultiTurnAgentExecutor

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(GuessTheNumber)

    async def execute(self, prompt, label, sampling_params):
        return await super().execute(prompt, label, sampling_params)
""",
}


@pytest.mark.parametrize("form", ["example", "0.11"])
def test_an_environment_class_goes_where_an_agent_instance_goes_in_both_generations(tok, tmp_path, form):
    path = tmp_path / "agent.py"
    path.write_text(GAME.read_text() + "\n\n" + GAME_WITH[form])  # the game, then an executor given its class
    engine = Scripted(tok, ["10", "30"])
    [ep] = run_episodes(engine, tok, str(path), [request(tok, "Guess.\n", "30")], max_steps=6, max_length=200,
                        seed=0, step_timeout=20, agent_workers=1, **SAMPLING)
    assert ep["finish"] == "done" and ep["reward"] == pytest.approx(0.9), ep["error"]
    assert ep["extra_logs"] == {"guesses": 2.0, "found": 1.0}


def test_a_tool_environment_renders_tools_and_feeds_results_back(tok, tmp_path):
    tok.chat_template = HERMES.read_text()
    path = tmp_path / "env.py"
    path.write_text("from rlhfkit.agents import Environment, Step\n\n"
                    "def add(a: int, b: int) -> int:\n    '''Add two integers.'''\n    return a + b\n\n"
                    "class Adder(Environment):\n    tools = [add]\n\n"
                    "    def step(self, action):\n"
                    "        if action.tool_calls or action.call_errors:\n"
                    "            return Step(self.call_tools(action), 0.0, False, {})\n"
                    "        import os\n"
                    "        return Step('', float(action.content.strip() == '5'), True, {'pid': os.getpid()})\n")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    engine = Scripted(tok, [call, "5"])
    [ep] = run_episodes(engine, tok, str(path), [request(tok, "What is 2+3?", "5")], max_steps=4, max_length=400,
                        seed=0, step_timeout=20, agent_workers=1, **SAMPLING)
    assert ep["finish"] == "done" and ep["reward"] == 1.0, ep["error"]
    logs = ep["extra_logs"]
    assert logs["tool_calls"] == 1.0 and logs["tool_errors"] == 0.0
    assert logs["pid"] != os.getpid()  # the environment ran in an agent worker process
    prompt = tok.decode(ep["prompt_ids"])
    assert '"name": "add"' in prompt and "What is 2+3?" in prompt  # the tools' schemas, through the template
    feedback = [t for t, m in zip(ep["response_ids"], ep["action_mask"]) if m == 0]
    assert "<tool_response>" in tok.decode(feedback) and "5" in tok.decode(feedback)
    assert ep["turn_log"][0]["tool_calls"] == [{"name": "add", "arguments": {"a": 2, "b": 3}, "result": "5",
                                                "ok": True}]  # what the run report's trace viewer shows


BAD_ENV = """
from rlhfkit.agents import Environment

class Bad(Environment):
    def step(self, action):
        if action.text.startswith("a"):
            return {"reward": 1.0}
        if action.text.startswith("b"):
            return "", float("nan"), True, {}
        if action.text.startswith("d"):  # messages, in text mode
            return [{"role": "user", "content": "x"}], 0.0, False, {}
        return "", 1.0, True, {}
"""


def test_an_environment_returning_wrong_types_costs_its_episode_counted_by_kind(tok, tmp_path):
    path = tmp_path / "env.py"
    path.write_text(BAD_ENV)
    answers = dict(zip("0123", "abcd"))  # by prompt: concurrent episodes reach the engine in any order

    def engine(prompt_ids, *, max_new_tokens, seed=None, **sampling):
        out = []
        for ids in prompt_ids:
            response = tok.encode(answers[tok.decode(ids).strip()[-1]], add_special_tokens=False)
            out.append(SampledSequence(list(ids), response + [tok.eos_token_id], [-0.5] * (len(response) + 1),
                                       FINISH_STOP))
        return out

    reqs = [request(tok, f"q{i}", "1") for i in range(4)]
    eps = run_episodes(engine, tok, str(path), reqs, max_steps=2, max_length=50, seed=0, step_timeout=20,
                       agent_workers=1, **SAMPLING)
    assert [e["finish"] for e in eps] == ["failed", "failed", "done", "failed"]
    assert "step returned messages, but the environment is in text mode" in eps[3]["error"]
    _, reward = episodes_to_samples(eps, fallback=-1.0, max_failure_ratio=0.75)
    assert reward["rewards"].tolist() == [-1.0, -1.0, 1.0, -1.0]
    assert reward["metrics"]["agent/failure_kinds/bad_output"] == 2.0
    assert reward["metrics"]["agent/failure_kinds/non_finite"] == 1.0
    with pytest.raises(UserError, match="3 of 4 episodes failed"):
        episodes_to_samples(eps, max_failure_ratio=0.5)


ENV_FILE = ("from rlhfkit.agents import Environment\n\ndef f(x):\n    return x\n\n"
            "class E(Environment):\n    tools = [f]\n")
TOOL_AGENT_FILE = """from rlhfkit.agents import ToolAgent, ToolAgentExecutor, tool_from_schema

def f(x: str) -> str:
    return x

class AgentInstance(ToolAgent):
    tools = [tool_from_schema({"name": "f", "parameters": {"type": "object", "properties": {"y": {}}}}, f)]

class AgentExecutor(ToolAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


@pytest.mark.parametrize("text, message", [
    (ENV_FILE, r"agent .*f.py: environment E: tool f: parameter 'x' has no type hint"),
    (TOOL_AGENT_FILE, r"agent .*f.py: importing it (in a worker )?failed \(UserError: tool f: the schema's "
                      r"properties \['y'\]"),
    (ENV_FILE.replace("tools = [f]", "pass").replace("class E", "class E2(Environment):\n    pass\n\nclass E"),
     "defines 2 Environment classes"),
])
def test_bad_declarations_stop_when_the_file_is_loaded_before_any_model(tmp_path, text, message):
    path = tmp_path / "f.py"
    path.write_text(text)
    with pytest.raises(UserError, match=message) as info:
        load_agent_executor(str(path))
    assert "\n" not in str(info.value)


def test_the_turns_calls_are_traced_with_their_results_in_call_tools_order():
    from rlhfkit.agents.env_agent import traced_calls

    action = Action(text="", tool_calls=[ToolCall("add", {"a": 1, "b": 2})], call_errors=["cut off"])
    answered = traced_calls(action, Adder().call_tools(action))
    assert answered == [{"name": None, "arguments": None, "result": "error: cut off", "ok": False},
                        {"name": "add", "arguments": {"a": 1, "b": 2}, "result": "3", "ok": True}]
    assert [c["result"] for c in traced_calls(action, "no tool messages")] == ["error: cut off", ""]
