"""Tool-call formats: how tools are shown to the policy, how its calls are parsed, and how a
tool's output is rendered back into the chat.

`hermes`: Qwen2.5 / Hermes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, with the
tool schemas rendered by the checkpoint's own chat template (`tools=`). `compact`: one line
`@name {json args}` and the tools' signatures on one line, for the tiny byte-level model.

Tool output is rendered through the chat template too: the text that follows an assistant
turn when a `tool` message is appended (and the next assistant turn opened), tokenized once.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_MARK = "\u00a7"  # placeholder assistant content; the suffix after it is the tool turn
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_COMPACT = re.compile(r"(?m)^\s*@([A-Za-z_][A-Za-z0-9_]*)")

SYSTEM = ("You are a coding agent working in a Python repository. Use the tools to read, edit "
          "and test the code, one tool call per turn; call `finish` when the task is done.")

COMPACT_SYSTEM = "You are a coding agent in a Python repository. Call finish when the task is done."


@dataclass(frozen=True)
class ToolCall:
    name: str
    args: dict[str, Any]


@dataclass(frozen=True)
class BadCall:
    reason: str  # shown to the agent as the observation


def _json_object(text: str, what: str) -> dict | BadCall:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return BadCall(f"{what} is not valid JSON ({e.msg} at position {e.pos})")
    if not isinstance(value, dict):
        return BadCall(f"{what} must be a JSON object")
    return value


class HermesFormat:
    name = "hermes"

    def prompt(self, tokenizer, task_prompt: str, schemas: list[dict]) -> str:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task_prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=schemas)

    def render_call(self, call: ToolCall) -> str:
        return "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.args}) + "\n</tool_call>"

    def parse(self, text: str) -> ToolCall | BadCall:
        found = _HERMES.findall(text)
        if not found:
            if "<tool_call>" in text:
                return BadCall("<tool_call> is not closed by </tool_call>")
            return BadCall("no tool call found; call one tool per turn inside <tool_call></tool_call>")
        if len(found) > 1:
            return BadCall(f"{len(found)} tool calls in one turn; make exactly one")
        obj = _json_object(found[0].strip(), "the tool call")
        if isinstance(obj, BadCall):
            return obj
        name, args = obj.get("name"), obj.get("arguments", {})
        if not isinstance(name, str):
            return BadCall('the tool call needs a string "name"')
        if isinstance(args, str):  # some checkpoints emit the arguments as a JSON string
            args = _json_object(args, '"arguments"')
            if isinstance(args, BadCall):
                return args
        if not isinstance(args, dict):
            return BadCall('"arguments" must be a JSON object')
        return ToolCall(name, args)


class CompactFormat:
    name = "compact"

    def prompt(self, tokenizer, task_prompt: str, schemas: list[dict]) -> str:
        # Names and arguments only: a byte-level model pays one token per character, and the
        # descriptions would be most of its context (it learns the tools from demonstrations).
        signatures = []
        for s in schemas:
            f = s["function"]
            required = f["parameters"]["required"]
            args = ", ".join(k if k in required else f"{k}?" for k in f["parameters"]["properties"])
            signatures.append(f"{f['name']}({args})")
        system = (f"{COMPACT_SYSTEM}\nTools: {'; '.join(signatures)}\n"
                  'Call one tool per line: @name {"arg": value}')
        messages = [{"role": "system", "content": system}, {"role": "user", "content": task_prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def render_call(self, call: ToolCall) -> str:
        return f"@{call.name} {json.dumps(call.args)}" if call.args else f"@{call.name}"

    def parse(self, text: str) -> ToolCall | BadCall:
        m = _COMPACT.search(text)
        if m is None:
            return BadCall('no tool call found; write one line: @name {"arg": value}')
        rest = text[m.end():].strip()
        if not rest:
            return ToolCall(m.group(1), {})
        try:
            args, end = json.JSONDecoder().raw_decode(rest)
        except json.JSONDecodeError as e:
            return BadCall(f"the arguments of @{m.group(1)} are not valid JSON ({e.msg})")
        if not isinstance(args, dict):
            return BadCall(f"the arguments of @{m.group(1)} must be a JSON object")
        if _COMPACT.search(rest[end:]):
            return BadCall("more than one tool call in one turn; make exactly one")
        return ToolCall(m.group(1), args)


FORMATS = {"hermes": HermesFormat, "compact": CompactFormat}


def make_format(name: str):
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call format {name!r}; choose one of {', '.join(FORMATS)}")
    return FORMATS[name]()


def observation_text(tokenizer, output: str, action_ended: bool) -> str:
    """The text appended after an assistant turn to show `output` as a tool message and open
    the next assistant turn. `action_ended`: the action ended with a stop token, so the
    template's end-of-turn marker (that token's text) is already in the context."""
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": _MARK}]
    full = tokenizer.apply_chat_template(base + [{"role": "tool", "content": output}],
                                         add_generation_prompt=True)
    suffix = full[full.index(_MARK) + len(_MARK):]  # the first mark is the placeholder
    if action_ended:
        stop = tokenizer.decode(tokenizer.stop_ids[:1], skip_special=False)
        if stop and suffix.startswith(stop):
            suffix = suffix[len(stop):]
    return suffix
