"""Tool-call parsing for the Hermes/Qwen, Llama 3 and Mistral formats: well-formed, multiple, nested, malformed and
partial (truncated) calls; format detection; and the round trip through test chat templates written in each
family's published format (tests/agents/tool_templates, rendered by the demo tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.agents.tool_parsers import FORMATS, ToolCall, detect_format, parse_tool_calls
from rlhfkit.config.rl_sections import TOOL_FORMATS

TEMPLATES = Path(__file__).resolve().parent / "tool_templates"
NESTED = {"query": "a } and a { and \"quotes\" and </tool_call> inside", "filters": {"tags": ["x", {"deep": [1, 2]}]},
          "n": 3}


def write(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """Calls written by hand the way each family's model writes them."""
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if fmt == "llama3":
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def test_the_config_layer_lists_the_same_formats():
    assert TOOL_FORMATS == FORMATS


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_call(fmt):
    parsed = parse_tool_calls(write(fmt, [("calculator", {"expression": "12*34"})]), fmt)
    assert parsed.calls == [ToolCall("calculator", {"expression": "12*34"})] and parsed.errors == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_multiple_and_nested_calls(fmt):
    calls = [("search", NESTED), ("calculator", {"expression": "(1+2)*3"}), ("noargs", {})]
    parsed = parse_tool_calls(write(fmt, calls), fmt)
    assert parsed.calls == [ToolCall(n, a) for n, a in calls] and parsed.errors == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_partial_call_is_an_error_not_a_crash(fmt):
    full = write(fmt, [("search", NESTED)])
    for cut in (len(full) // 3, len(full) // 2, len(full) - 3):
        parsed = parse_tool_calls(full[:cut], fmt)
        assert parsed.calls == [] and len(parsed.errors) == 1, (cut, parsed)
        assert parsed.errors[0].startswith("partial tool call"), parsed.errors


@pytest.mark.parametrize("fmt, text, message", [
    ("hermes", '<tool_call>{"name": calc}</tool_call>', "malformed tool call: Expecting value"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', 'needs a "name"'),
    ("hermes", '<tool_call>{"name": "c", "arguments": 3}</tool_call>', "arguments must be a JSON object"),
    ("hermes", '<tool_call>{"name": "c"} trailing</tool_call>', "text after the JSON"),
    ("hermes", '<tool_call>{"name": "c", "arguments": {"x": 1</tool_call>', "malformed tool call"),
    ("hermes", '<tool_call>["c"]</tool_call>', "must be a JSON object, got list"),
    ("llama3", '<|python_tag|>{"name": "c", "parameters": {"x": }}', "malformed tool call"),
    ("llama3", '{"name": "c", "parameters": "not json"}', "arguments are a string that is not JSON"),
    ("mistral", "[TOOL_CALLS] calc(1)", "must be followed by a JSON list"),
    ("mistral", '[TOOL_CALLS][{"name": "c", "arguments": {"x": 1}}, 7]', "must be a JSON object, got int"),
])
def test_malformed_calls_become_error_lines(fmt, text, message):
    parsed = parse_tool_calls(text, fmt)
    assert parsed.attempted and any(message in e for e in parsed.errors), parsed


def test_good_calls_beside_a_malformed_one_are_kept():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{oops}</tool_call>'
            ' <tool_call>{"name": "b", "arguments": {"s": "}"}}</tool_call>')
    parsed = parse_tool_calls(text, "hermes")
    assert [c.name for c in parsed.calls] == ["a", "b"] and len(parsed.errors) == 1


def test_arguments_given_as_a_json_string_are_read():
    text = '<tool_call>{"name": "c", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert parse_tool_calls(text, "hermes").calls == [ToolCall("c", {"x": 1})]


@pytest.mark.parametrize("fmt, text", [("hermes", "The answer is 408."), ("llama3", "It is {not} a call: 408"),
                                       ("mistral", "408, I think")])
def test_plain_text_is_no_call(fmt, text):
    parsed = parse_tool_calls(text, fmt)
    assert not parsed.attempted and parsed.content == text.strip()


def test_content_outside_the_calls_is_kept():
    parsed = parse_tool_calls('Let me compute. <tool_call>{"name": "c", "arguments": {}}</tool_call>', "hermes")
    assert parsed.content == "Let me compute." and len(parsed.calls) == 1


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="use one of hermes, llama3, mistral"):
        parse_tool_calls("x", "pythonic")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_test_templates_are_detected(fmt):
    assert detect_format((TEMPLATES / f"{fmt}.jinja").read_text()) == fmt


def test_a_template_without_tools_shows_no_format():
    from rlhfkit.demo.tokenizer import CHAT_TEMPLATE

    assert detect_format(CHAT_TEMPLATE) is None and detect_format(None) is None


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_assets.model_dir)


@pytest.mark.parametrize("fmt", FORMATS)
def test_calls_rendered_by_each_template_parse_back(tokenizer, fmt):
    """An assistant turn with tool_calls, rendered by the family's template, parses back to the same calls."""
    tokenizer.chat_template = (TEMPLATES / f"{fmt}.jinja").read_text()
    calls = [("search", NESTED), ("calculator", {"expression": "2**10"})]
    user = [{"role": "user", "content": "hi"}]
    turn = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    before = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [turn], tokenize=False)
    assert full.startswith(before)
    sampled = full[len(before):].rsplit(tokenizer.eos_token, 1)[0]  # what the model writes before its eos
    assert parse_tool_calls(sampled, fmt).calls == [ToolCall(n, a) for n, a in calls]
