"""Tool declarations (schemas derived from typed functions, written schemas checked as JSON Schema) and tool calls
in the user-code worker pool, where a tool that raises or hangs costs its call."""

from __future__ import annotations

import textwrap
from typing import Literal

import pytest

from rlhfkit.agents.tools import argument_errors, as_tools, close_pools, run_tool, tool_from_function, tool_from_schema
from rlhfkit.errors import UserError


def lookup(city: str, days: int, unit: Literal["c", "f"] = "c", tags: list[str] | None = None,
           precise: bool = False, scale: float = 1.0) -> str:
    """Look up the weather.

    A second paragraph the schema leaves out.

    Args:
        city: the city's name.
        days (int): how many days ahead.

    Returns:
        the forecast.
    """
    return city


def test_the_schema_is_derived_from_hints_and_docstring():
    tool = tool_from_function(lookup)
    assert tool.schema == {"type": "function", "function": {
        "name": "lookup", "description": "Look up the weather.",
        "parameters": {"type": "object", "required": ["city", "days"], "properties": {
            "city": {"type": "string", "description": "the city's name."},
            "days": {"type": "integer", "description": "how many days ahead."},
            "unit": {"type": "string", "enum": ["c", "f"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "precise": {"type": "boolean"}, "scale": {"type": "number"}}}}}


def test_a_function_without_type_hints_is_one_line():
    def add(a, b: int) -> int:
        return a + b

    with pytest.raises(UserError, match="tool add: parameter 'a' has no type hint") as info:
        tool_from_function(add)
    assert "\n" not in str(info.value)


def test_an_unsupported_hint_and_varargs_are_refused():
    def f(x: complex) -> None: ...

    def g(*xs: int) -> None: ...

    with pytest.raises(UserError, match="no JSON Schema here"):
        tool_from_function(f)
    with pytest.raises(UserError, match=r"\*xs"):
        tool_from_function(g)


@pytest.mark.parametrize("schema, message", [
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                   "properties": {"x": {"type": "strng"}}}}},
     "not valid JSON Schema at properties/x/type"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}},
     "not valid JSON Schema at required"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}, "type\": \"object\""),
    ({"type": "function", "function": {"parameters": {}}}, "needs a \"name\""),
    ({"name": "bad name!"}, "needs a \"name\""),
])
def test_a_bad_schema_is_one_line(schema, message):
    with pytest.raises(UserError, match=message) as info:
        tool_from_schema(schema, lookup)
    assert "\n" not in str(info.value)


def test_a_written_schema_and_the_inner_function_form_are_taken():
    params = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    outer = tool_from_schema({"type": "function", "function": {"name": "weather", "description": "d",
                                                               "parameters": params}}, lookup)
    inner = tool_from_schema({"name": "weather", "description": "d", "parameters": params}, lookup)
    assert outer.schema == inner.schema and outer.name == "weather" and outer.parameters == params


def test_arguments_are_checked_against_the_schema():
    tool = tool_from_function(lookup)
    assert argument_errors(tool, {"city": "Oslo", "days": 2}) == ""
    assert "'days' is a required property" in argument_errors(tool, {"city": "Oslo"})
    assert "is not of type 'integer'" in argument_errors(tool, {"city": "Oslo", "days": "2"})
    assert "is not one of" in argument_errors(tool, {"city": "Oslo", "days": 2, "unit": "k"})


def test_a_schema_that_does_not_fit_its_function_is_one_line():
    def weather(city: str, *, days: int = 1) -> str:
        return city

    def anything(**kwargs: str) -> str:
        return ""

    def positional(city: str, /) -> str:
        return city

    params = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}}
    with pytest.raises(UserError, match=r"tool w: the schema's properties \['country'\] are not parameters of "
                                        r"weather\(city"):
        tool_from_schema({"name": "w", "parameters": params}, weather)
    assert tool_from_schema({"name": "w", "parameters": params}, anything).name == "w"
    with pytest.raises(UserError, match="positional-only parameters; a tool is called with keywords"):
        tool_from_schema({"name": "w", "parameters": params}, positional)
    assert tool_from_schema({"name": "w", "parameters": None}, anything).parameters == {"type": "object",
                                                                                         "properties": {}}


def test_tool_names_must_be_unique():
    with pytest.raises(UserError, match="names must be unique"):
        as_tools([lookup, lookup])


TOOLS_FILE = '''
import time

def add(a: int, b: int) -> int:
    """Add."""
    return a + b

def boom(x: str) -> str:
    """Raise."""
    raise ValueError("no such thing: " + x)

def hang(x: str) -> str:
    """Hang."""
    time.sleep(60)
    return x

def unsendable(x: str) -> object:
    """A value a worker cannot send back."""
    return lambda: x
'''


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(textwrap.dedent(TOOLS_FILE))
    namespace: dict = {"__file__": str(path)}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # functions whose file is my_tools.py
    yield {name: tool_from_function(namespace[name]) for name in ("add", "boom", "hang", "unsendable")}
    close_pools()


def test_a_tool_runs_in_a_worker(tools):
    assert run_tool(tools["add"], {"a": 2, "b": 3}, timeout=20) == ("5", "")


def test_a_tool_that_raises_or_hangs_costs_its_call(tools):
    text, kind = run_tool(tools["boom"], {"x": "y"}, timeout=20)
    assert kind == "exception" and text.startswith("error: tool boom failed (exception:") and "no such thing: y" in text
    text, kind = run_tool(tools["hang"], {"x": "y"}, timeout=1)
    assert kind == "timeout" and text.startswith("error: tool hang failed (timeout")
    text, kind = run_tool(tools["unsendable"], {"x": "y"}, timeout=20)
    assert kind == "bad_output" and text.startswith("error: tool unsendable failed")


def test_a_tool_must_be_a_module_level_function():
    def local(x: str) -> str:
        return x

    with pytest.raises(UserError, match="top level of a .py file"):
        run_tool(tool_from_function(local), {"x": "1"}, timeout=5)
