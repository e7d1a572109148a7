"""The tool agent's episodes: tools rendered through the chat template, calls parsed in each family's format, tool
results fed back as the template's delta (tokenised once, masked), the model's turns kept as the exact sampled ids,
and bad calls (malformed, unknown tool, wrong arguments, a tool that raises) costing only their call."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlhfkit.agents.episodes import run_episodes
from rlhfkit.agents.tools import close_pools
from rlhfkit.errors import UserError
from rlhfkit.rollout.engine import FINISH_STOP, SampledSequence

TEMPLATES = Path(__file__).resolve().parent / "tool_templates"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_tools.py"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}


@pytest.fixture(scope="module")
def tok(demo_assets):
    yield AutoTokenizer.from_pretrained(demo_assets.model_dir)
    close_pools()


def call_text(fmt: str, calls: list[tuple[str, dict]]) -> str:
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if fmt == "llama3":
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


class ScriptedEngine:
    """An engine whose turns are given texts (as ids, each ending with eos), with made-up log-probs; it keeps
    every context it was asked to continue."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.contexts, self.samples = tok, list(turns), [], []

    def __call__(self, prompt_ids, *, max_new_tokens, seed=None, **sampling):
        out = []
        for ids in prompt_ids:
            text = self.turns.pop(0)
            response = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
            sample = SampledSequence(list(ids), response, [-0.5 - i / 100 for i in range(len(response))],
                                     FINISH_STOP)
            self.contexts.append(list(ids))
            self.samples.append(sample)
            out.append(sample)
        return out


def episode(tok, fmt: str, turns: list[str], label="408", **kwargs):
    tok.chat_template = (TEMPLATES / f"{fmt}.jinja").read_text()
    engine = ScriptedEngine(tok, turns)
    request = {"prompt": "What is 12*34?", "prompt_ids": [tok.bos_token_id] + tok.encode("What is 12*34?"),
               "label": label}
    [ep] = run_episodes(engine, tok, str(EXAMPLE), [request], max_steps=4, max_length=400, seed=0,
                        step_timeout=20, agent_workers=2, **kwargs, **SAMPLING)
    return ep, engine


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_trained_tokens_are_the_sampled_ones_and_feedback_is_the_template_delta(tok, fmt):
    call = call_text(fmt, [("calculator", {"expression": "12*34"})])
    ep, engine = episode(tok, fmt, [call, "The answer is 408."])
    assert ep["finish"] == "done" and ep["turns"] == 2 and ep["reward"] == 1.0
    s1, s2 = engine.samples
    # the prompt: the user's question rendered with the tools' schemas
    messages = [{"role": "user", "content": "What is 12*34?"}]
    tools = [{"type": "function", "function": {"name": "calculator", "description": (
        "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses)."), "parameters": {
        "type": "object", "properties": {"expression": {"type": "string", "description": (
            'the expression to evaluate, e.g. "12*34".')}}, "required": ["expression"]}}}]
    rendered = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ep["prompt_ids"] == [tok.bos_token_id] + tok.encode(rendered[len(tok.bos_token):],
                                                               add_special_tokens=False)
    # the feedback: what the template writes after the assistant turn for the tool result (eos already sampled)
    tool_msg = {"role": "tool", "name": "calculator", "content": "408", "tool_call_id": "call00002"}
    turn = {"role": "assistant", "content": "@@"}
    full = tok.apply_chat_template(messages + [turn, tool_msg], tools=tools, tokenize=False,
                                   add_generation_prompt=True)
    feedback = full.split("@@", 1)[1].removeprefix(tok.eos_token)
    assert "408" in feedback and feedback
    feedback_ids = tok.encode(feedback, add_special_tokens=False)
    assert ep["response_ids"] == s1.response_ids + feedback_ids + s2.response_ids
    assert ep["action_mask"] == [1] * len(s1.response_ids) + [0] * len(feedback_ids) + [1] * len(s2.response_ids)
    assert ep["logprobs"] == s1.logprobs + [0.0] * len(feedback_ids) + s2.logprobs
    # the second turn continued exactly the context the trainer sees: prompt, sampled ids, feedback ids
    assert engine.contexts[1] == ep["prompt_ids"] + s1.response_ids + feedback_ids
    logs = ep["extra_logs"]
    assert logs["tool_calls"] == 1 and logs["tool_errors"] == 0 and logs["valid_call_rate"] == 1.0


def test_bad_calls_cost_the_call_are_counted_and_the_episode_goes_on(tok):
    turns = ['<tool_call>{"name": calculator}</tool_call>',                       # malformed JSON
             call_text("hermes", [("search", {"q": "x"}), ("calculator", {})]),     # unknown tool, missing arg
             call_text("hermes", [("calculator", {"expression": "1/0"})]),         # the tool raises
             '<tool_call>{"name": "calculator", "arguments": {"expression": "1']   # cut off: partial (counted)
    ep, engine = episode(tok, "hermes", turns)
    assert ep["finish"] == "turns" and ep["turns"] == 4 and ep["error"] == ""
    fed = [tok.decode(engine.contexts[i][len(engine.contexts[i - 1]):], skip_special_tokens=False)
           for i in (1, 2, 3)]
    assert "error: malformed tool call" in fed[0]
    assert "error: unknown tool 'search'" in fed[1] and "'expression' is a required property" in fed[1]
    assert "error: tool calculator failed (exception: calculator raised ValueError: division by zero)" in fed[2]
    logs = ep["extra_logs"]
    assert logs["tool_errors"] == 2 and logs["tool_calls"] == 3 and logs["tool_failures"] == 3
    assert logs["valid_call_rate"] == 0.0


def test_the_format_can_be_set_by_flag(tok):
    call = call_text("llama3", [("calculator", {"expression": "12*34"})])
    tok.chat_template = (TEMPLATES / "hermes.jinja").read_text()
    ep, _ = episode(tok, "hermes", [call, "408"], tool_format="llama3")  # the hermes template, llama3 calls
    assert ep["extra_logs"]["tool_calls"] == 1 and ep["reward"] == 1.0


def test_a_template_without_a_tool_format_stops_before_any_episode(tok):
    from rlhfkit.demo.tokenizer import CHAT_TEMPLATE

    tok.chat_template = CHAT_TEMPLATE
    engine = ScriptedEngine(tok, ["408"])
    request = {"prompt": "q", "prompt_ids": [tok.bos_token_id], "label": "408"}
    with pytest.raises(UserError, match="shows no tool-call format"):
        run_episodes(engine, tok, str(EXAMPLE), [request], max_steps=2, max_length=64, **SAMPLING)
    assert engine.contexts == []


BAD_AGENT = '''
from rlhfkit.agents import ToolAgent, ToolAgentExecutor, tool_from_schema

def calc(expression{hint}) -> str:
    return expression

TOOL = {tool}

class AgentInstance(ToolAgent):
    tools = [TOOL]
    def final_reward(self, answer, label):
        return 0.0

class AgentExecutor(ToolAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''
BAD_SCHEMA = ('tool_from_schema({"name": "calc", "parameters": {"type": "object", '
              '"properties": {"expression": {"type": "strng"}}}}, calc)')


@pytest.mark.parametrize("hint, tool, message", [
    (": str", BAD_SCHEMA, "tool calc: parameters is not valid JSON Schema at properties/expression/type"),
    ("", "calc", "tool calc: parameter 'expression' has no type hint; .* `def calc\\(expression: str\\) -> str`"),
])
def test_a_bad_tool_declaration_stops_with_one_line_before_any_episode(tok, tmp_path, hint, tool, message):
    path = tmp_path / "agent.py"
    path.write_text(BAD_AGENT.format(hint=hint, tool=tool))
    tok.chat_template = (TEMPLATES / "hermes.jinja").read_text()
    engine = ScriptedEngine(tok, ["408"])
    request = {"prompt": "q", "prompt_ids": [tok.bos_token_id], "label": "408"}
    with pytest.raises(UserError, match=message) as info:
        run_episodes(engine, tok, str(path), [request], max_steps=2, max_length=64, **SAMPLING)
    assert "\n" not in str(info.value) and engine.contexts == []
