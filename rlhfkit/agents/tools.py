"""Tools an agent offers the model: declared as OpenAI function schemas or derived from typed Python functions.

A `Tool` is a name, its OpenAI function schema (`{"type": "function", "function": {"name", "description",
"parameters"}}`, what `tokenizer.apply_chat_template(..., tools=[...])` renders) and the module-level function
that runs it. `tool_from_function(fn)` derives the schema from the signature (every parameter must have a type
hint: str, int, float, bool, list[...], dict, Literal[...], Optional) and the docstring (the first paragraph is the
description; a Google-style `Args:` section describes the parameters). `tool_from_schema(schema, fn)` takes a
written schema, checked against the JSON Schema meta-schema. A bad declaration is a `UserError` (one line, exit 2)
when the agent file is loaded, before any episode runs.

`ToolRunner` calls the functions in the user-code worker pool (rlhfkit.rewards.user_code: the agent file imported
in worker processes, each call with a timeout), so a tool that raises, hangs or crashes costs its call: the model
reads an error message instead of a result, and the agent counts it.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rlhfkit.errors import UserError

_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}
_ARG_LINE = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.+)$")


@dataclass
class Tool:
    """One tool: its name, its OpenAI function schema and the function that runs it."""

    name: str
    schema: dict[str, Any]
    function: Callable[..., Any]

    @property
    def parameters(self) -> dict[str, Any]:
        return dict(self.schema["function"].get("parameters") or {"type": "object", "properties": {}})


def _json_type(hint: Any, where: str) -> dict[str, Any]:
    """The JSON Schema of a type hint."""
    if hint in _SIMPLE:
        return {"type": _SIMPLE[hint]}
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return {"type": _SIMPLE.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (list, Sequence, tuple) and args:
        return {"type": "array", "items": _json_type(args[0], where)}
    if origin in (dict,):
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        if len(kept) == 1:
            return _json_type(kept[0], where)
    raise UserError(f"{where}: type {hint!r} has no JSON Schema here (use str, int, float, bool, list[...], dict, "
                    "Literal[...] or Optional[...])")


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """(description: the first paragraph, {parameter: its line in the `Args:` section})."""
    text = inspect.cleandoc(doc or "")
    description = text.split("\n\n", 1)[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    in_args = False
    for line in text.splitlines():
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            in_args = True
        elif in_args and line.strip() and not line.startswith((" ", "\t")):
            in_args = False  # the next section
        elif in_args and (match := _ARG_LINE.match(line)):
            params[match.group(1)] = match.group(2).strip()
    return description, params


def tool_from_function(fn: Callable[..., Any]) -> Tool:
    """A tool whose schema comes from `fn`'s type hints and docstring; UserError if a parameter has no hint."""
    name = getattr(fn, "__name__", repr(fn))
    where = f"tool {name}"
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # noqa: BLE001 - an unresolvable annotation is the user's
        raise UserError(f"{where}: its type hints cannot be resolved ({type(e).__name__}: {e})") from None
    description, documented = _docstring_parts(fn.__doc__ or "")
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise UserError(f"{where}: *{param.name} / **{param.name} cannot be described as JSON Schema; name "
                            "each parameter")
        if param.name not in hints:
            raise UserError(f"{where}: parameter {param.name!r} has no type hint; a tool's schema is derived from "
                            f"its type hints (e.g. `def {name}({param.name}: str) -> str`)")
        properties[param.name] = _json_type(hints[param.name], f"{where}, parameter {param.name!r}")
        if param.name in documented:
            properties[param.name]["description"] = documented[param.name]
        if param.default is param.empty:
            required.append(param.name)
    parameters = {"type": "object", "properties": properties, "required": required}
    schema = {"type": "function", "function": {"name": name, "description": description or name,
                                               "parameters": parameters}}
    return tool_from_schema(schema, fn)


def tool_from_schema(schema: dict[str, Any], fn: Callable[..., Any]) -> Tool:
    """A tool declared by an OpenAI function schema (or its inner `function` object), run by `fn`."""
    import jsonschema

    spec = schema.get("function", schema) if isinstance(schema, dict) else None
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][\w.-]{0,63}", name):
        raise UserError(f"tool schema {json.dumps(schema)[:80]}: needs a \"name\" (letters, digits, _ . -); the "
                        "OpenAI form is {\"type\": \"function\", \"function\": {\"name\", \"description\", "
                        "\"parameters\"}}")
    assert isinstance(spec, dict)
    parameters = spec.get("parameters")
    if parameters is None:  # absent or null: a tool without arguments, as OpenAI's API reads it
        parameters = {"type": "object", "properties": {}}
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as e:
        path = "/".join(str(p) for p in e.absolute_path) or "(top)"
        raise UserError(f"tool {name}: parameters is not valid JSON Schema at {path}: {e.message}") from None
    if not isinstance(parameters, dict) or parameters.get("type") != "object":
        raise UserError(f"tool {name}: parameters must be a JSON Schema of \"type\": \"object\" (the arguments)")
    if not callable(fn):
        raise UserError(f"tool {name}: {fn!r} is not a function")
    _check_signature(name, parameters, fn)
    full = {"type": "function", "function": {"name": name, "description": str(spec.get("description", "")),
                                             "parameters": parameters}}
    return Tool(name, full, fn)


def _check_signature(name: str, parameters: dict[str, Any], fn: Callable[..., Any]) -> None:
    """The schema's arguments must fit the function that runs it (it is called with them as keywords): every
    property a parameter of it (or taken by its **kwargs). Otherwise every call that passes one fails at run time
    with a TypeError the model cannot fix: a declaration mistake, found before training."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to compare
        return
    fn_name = getattr(fn, "__name__", repr(fn))
    if any(p.kind == p.POSITIONAL_ONLY and p.default is p.empty for p in params.values()):
        raise UserError(f"tool {name}: {fn_name} has positional-only parameters; a tool is called with keywords")
    properties = parameters.get("properties") or {}
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        unknown = [k for k in properties if k not in params]
        if unknown:
            raise UserError(f"tool {name}: the schema's properties {unknown} are not parameters of "
                            f"{fn_name}{inspect.signature(fn)}")


def as_tools(declared: Sequence[Any]) -> list[Tool]:
    """An agent's tool list (functions or Tools) as Tools, names unique."""
    tools = [t if isinstance(t, Tool) else tool_from_function(t) for t in declared]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise UserError(f"tools: names must be unique (got {names})")
    return tools


def argument_errors(tool: Tool, arguments: dict[str, Any]) -> str:
    """Why `arguments` do not fit the tool's parameters schema ("" when they do)."""
    import jsonschema

    validator = jsonschema.validators.validator_for(tool.parameters)(tool.parameters)
    error = jsonschema.exceptions.best_match(validator.iter_errors(arguments))
    return "" if error is None else error.message


_POOLS: dict[tuple[str, int, float], Any] = {}


def _pool(path: str, workers: int, timeout: float) -> Any:
    """The worker pool of a tools file in this process (started at its first call, reused by every episode)."""
    from rlhfkit.rewards.user_code import UserCodeLoadError, UserCodePool

    key = (path, workers, timeout)
    if key not in _POOLS:
        try:
            _POOLS[key] = UserCodePool(path, workers=workers, timeout=timeout)
        except UserCodeLoadError as e:
            raise UserError(f"tools {path}: importing it in a worker failed ({e})") from None
    return _POOLS[key]


def close_pools() -> None:
    """Stop every tool worker pool of this process (tests; the workers also exit with their parent)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def tool_location(tool: Tool) -> tuple[str, str]:
    """(file, function name) where a worker finds the tool's function: a module-level function of a file."""
    fn = tool.function
    name = getattr(fn, "__name__", "")
    try:
        path = inspect.getfile(fn)
    except TypeError:
        path = ""
    if not path.endswith(".py") or getattr(fn, "__qualname__", "") != name or name == "<lambda>":
        raise UserError(f"tool {tool.name}: its function must be defined at the top level of a .py file (the "
                        "agent file), where a worker process can import it; not a lambda, method or nested function")
    return path, name


def run_tool(tool: Tool, arguments: dict[str, Any], timeout: float, workers: int = 2) -> tuple[str, str]:
    """Call the tool in the user-code pool: (its result as text, "") or (an error message, the failure kind).

    A failure (exception, timeout, crash, an unsendable result) costs this call only; its message is what the
    model reads back."""
    path, name = tool_location(tool)
    result = _pool(path, workers, timeout).call(name, **arguments)
    if not result.ok:
        return f"error: tool {tool.name} failed ({result.kind}: {result.error})", str(result.kind)
    value = result.value
    return (value if isinstance(value, str) else json.dumps(value, default=str)), ""
