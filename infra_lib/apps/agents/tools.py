"""Tools: functions a model may call, described by a JSON schema, with arguments checked first.

A model never calls a function; it writes a request (``{"name": ..., "arguments": {...}}``) and
the runtime decides. So the runtime validates the arguments against the tool's JSON schema
before calling, and whatever goes wrong (an unknown tool, a missing or mistyped argument, an
exception inside the tool) comes back to the model as a tool message starting with
``error:``, which it can read and correct. A bad tool call is data, never a crash of the run.

``@tool`` builds the schema from the function's type hints and its Google-style docstring.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

_ARG_LINE = re.compile(r"^ {4}(\w+)(?: \(.*?\))?:(.*)$")  # "    name (type): text"
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object", list: "array"}


def _validator():
    """jsonschema's validator class (imported on first use: the package takes a second to import)."""
    from jsonschema import Draft202012Validator

    return Draft202012Validator


@dataclass(frozen=True)
class ToolCall:
    """A model's request to call tool ``name`` with ``arguments``; ``id`` pairs it with its result message."""

    name: str
    arguments: dict
    id: str = "call_0"

    def as_dict(self) -> dict:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class Tool:
    """A function the model may call.

    Attributes:
        name: what the model writes to call it.
        description: what it does, for the model.
        parameters: a JSON schema of its keyword arguments (``{"type": "object", "properties": ...}``).
        fn: the function, called as ``fn(**arguments)``.
    """

    name: str
    description: str
    parameters: dict
    fn: Callable[..., Any] = field(repr=False)

    def __post_init__(self):
        if not self.name or not self.name.replace("_", "").isalnum():
            raise ValueError(f"a tool name must be letters, digits and underscores, got {self.name!r}")
        _validator().check_schema(self.parameters)
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be an object schema, got {self.parameters!r}")

    def schema(self) -> dict:
        """What the model is shown: name, description and the parameters' schema."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def argument_errors(self, arguments: Any) -> list[str]:
        """What is wrong with ``arguments`` (empty: they fit the schema)."""
        if not isinstance(arguments, dict):
            return [f"arguments must be a JSON object, got {type(arguments).__name__}"]
        validator = _validator()(self.parameters)
        return [
            f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: {e.message}"
            for e in sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
        ]


def json_schema_of(hint: Any, where: str) -> dict:
    """The JSON schema of a Python type hint (int, float, str, bool, list[T], dict, Literal, T | None)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin is list:
        return {"type": "array", "items": json_schema_of(args[0], where)} if args else {"type": "array"}
    if origin is dict:
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = next(a for a in args if a is not type(None))
        return {"anyOf": [json_schema_of(inner, where), {"type": "null"}]}
    raise TypeError(
        f"{where}: no JSON schema for the type hint {hint!r}; use int, float, str, bool, list[...], "
        "dict, Literal[...] or T | None, or build the Tool with an explicit schema"
    )


def _docstring_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The summary paragraph and the ``Args:`` descriptions of a Google-style docstring."""
    lines = inspect.cleandoc(doc or "").splitlines() + [""]
    summary = " ".join(line.strip() for line in lines[: lines.index("")])
    described, current, in_args = {}, None, False
    for line in lines:
        entry = _ARG_LINE.match(line)
        if line.strip() in ("Args:", "Arguments:"):
            in_args = True
        elif in_args and line and not line.startswith(" "):
            in_args = False  # the next section (Returns:, Raises:, ...)
        elif in_args and entry:
            current = entry.group(1)
            described[current] = entry.group(2).strip()
        elif in_args and current and line.strip():
            described[current] += " " + line.strip()
    return summary, described


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Tool | Callable[[Callable], Tool]:
    """Make a ``Tool`` of a function: ``@tool`` or ``@tool(name="...")``.

    The parameters' schema comes from the type hints (every parameter needs one; those without
    a default are required, no others are allowed), the descriptions from the docstring.
    """

    def build(f: Callable[..., Any]) -> Tool:
        hints = typing.get_type_hints(f)
        summary, described = _docstring_parts(f.__doc__ or "")
        properties, required = {}, []
        for param in inspect.signature(f).parameters.values():
            where = f"tool {f.__name__!r}, parameter {param.name!r}"
            if param.name not in hints:
                raise TypeError(f"{where} needs a type hint (the model is shown its JSON type)")
            properties[param.name] = json_schema_of(hints[param.name], where)
            if param.name in described:
                properties[param.name]["description"] = described[param.name]
            if param.default is inspect.Parameter.empty:
                required.append(param.name)
        parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
        return Tool(name or f.__name__, summary or f.__name__, parameters, f)

    return build(fn) if fn is not None else build


def tool_message(call_id: str, name: str, content: str) -> dict:
    """The message that carries a tool's result (or ``error: ...``) back to the model."""
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


def run_tool_call(tools: dict[str, Tool] | Iterable[Tool], call: ToolCall | dict) -> dict:
    """Validate and run one tool call; the result, or what went wrong, as a tool message (never an exception).

    Args:
        tools: the tools the model may call, by name (or a list of them).
        call: a ``ToolCall`` or its dict form (``{"id", "name", "arguments"}``).

    Returns:
        ``{"role": "tool", "tool_call_id", "name", "content"}``; content starts with ``error:`` on failure.
    """
    tools = tools if isinstance(tools, dict) else {t.name: t for t in tools}
    if isinstance(call, dict):
        call = ToolCall(str(call.get("name")), call.get("arguments"), str(call.get("id", "call_0")))
    if call.name not in tools:
        return tool_message(
            call.id,
            call.name,
            f"error: there is no tool named {call.name!r}; available tools: {', '.join(sorted(tools))}",
        )
    chosen = tools[call.name]
    problems = chosen.argument_errors(call.arguments)
    if problems:
        return tool_message(call.id, call.name, f"error: bad arguments for {call.name}: {'; '.join(problems)}")
    try:
        result = chosen.fn(**call.arguments)
    except Exception as error:  # the model reads the error and may try again
        return tool_message(call.id, call.name, f"error: {call.name} raised {type(error).__name__}: {error}")
    return tool_message(call.id, call.name, result if isinstance(result, str) else json.dumps(result, default=str))
