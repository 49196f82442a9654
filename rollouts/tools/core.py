"""Tool records, argument checking and dispatch: a tool is declared once (name, description,
JSON-schema parameters, function) and both rendered into the prompt and called from here.

A tool function gets a `ToolContext` and its checked arguments and returns the observation
text; it raises `ToolError` for anything the agent did wrong (the message becomes the
observation). Nothing a tool call does can raise past `Toolbox.call`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

_JSON_TYPES = {"string": str, "integer": int, "boolean": bool}


class ToolError(Exception):
    """The agent's call was wrong (bad path, absent search text, ...); shown to the agent."""


@dataclasses.dataclass(frozen=True)
class Param:
    name: str
    type: str  # "string" | "integer" | "boolean"
    description: str
    required: bool = True
    enum: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: tuple[Param, ...]
    fn: Callable[..., str]

    def schema(self) -> dict:
        """The OpenAI/Hermes function schema (what chat templates render as `tools`)."""
        props = {}
        for p in self.params:
            props[p.name] = {"type": p.type, "description": p.description}
            if p.enum:
                props[p.name]["enum"] = list(p.enum)
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": props,
                    "required": [p.name for p in self.params if p.required],
                },
            },
        }

    def signature(self) -> str:
        """One line for compact prompts: `name(a: string, b?: integer) - description`."""
        args = ", ".join(
            f"{p.name}{'' if p.required else '?'}: {p.type}" for p in self.params
        )
        return f"{self.name}({args}) - {self.description}"

    def check_args(self, args: Any) -> dict:
        if not isinstance(args, dict):
            raise ToolError(f"{self.name}: arguments must be a JSON object")
        known = {p.name: p for p in self.params}
        unknown = sorted(set(args) - set(known))
        if unknown:
            raise ToolError(
                f"{self.name}: unknown argument(s) {', '.join(unknown)}; "
                f"expected {', '.join(known) or 'none'}"
            )
        for p in self.params:
            if p.name not in args:
                if p.required:
                    raise ToolError(f"{self.name}: missing required argument '{p.name}'")
                continue
            value = args[p.name]
            ok = isinstance(value, _JSON_TYPES[p.type]) and not (
                p.type == "integer" and isinstance(value, bool)
            )
            if not ok:
                raise ToolError(f"{self.name}: argument '{p.name}' must be a {p.type}")
            if p.enum and value not in p.enum:
                raise ToolError(
                    f"{self.name}: argument '{p.name}' must be one of {', '.join(p.enum)}"
                )
        return dict(args)


@dataclasses.dataclass(frozen=True)
class ToolOutput:
    text: str
    ok: bool  # False: the call was malformed, unknown, or raised ToolError
    finished: bool = False  # the agent called `finish`
    bad_call: bool = False  # no tool of that name, or arguments that fit no schema


def truncate(text: str, max_chars: int) -> str:
    """Head and tail of `text` with a note of what was cut (the tail holds the errors)."""
    if len(text) <= max_chars:
        return text
    head, tail = max_chars * 2 // 3, max_chars // 3
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters truncated ...]\n{text[len(text) - tail:]}"


class Toolbox:
    """The tools of an episode, by name."""

    def __init__(self, tools: Sequence[Tool]):
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError("tool names must be unique")

    def schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def call(self, ctx, name: str, args: Any, max_chars: int) -> ToolOutput:
        tool = self.tools.get(name)
        if tool is None:
            return ToolOutput(
                f"error: unknown tool {name!r}; available: {', '.join(self.tools)}",
                ok=False,
                bad_call=True,
            )
        try:
            args = tool.check_args(args)
        except ToolError as e:
            return ToolOutput(f"error: {e}", ok=False, bad_call=True)
        try:
            text = tool.fn(ctx, **args)
        except ToolError as e:
            return ToolOutput(f"error: {e}", ok=False)
        return ToolOutput(truncate(text, max_chars), ok=True, finished=name == "finish")
