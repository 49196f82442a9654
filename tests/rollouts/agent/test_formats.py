"""Tool-call formats: Hermes with a Qwen2.5 chat template, compact for the byte model."""

from __future__ import annotations

import json

import pytest

from jaxagent.tokenizer import ByteTokenizer
from rollouts.agent import BadCall, ToolCall, make_format, observation_text
from rollouts.tools import TOOLS, Toolbox

SCHEMAS = Toolbox(TOOLS).schemas()


def test_hermes_prompt_renders_schemas_through_the_chat_template(qwen_tok):
    fmt = make_format("hermes")
    text = fmt.prompt(qwen_tok, "fix the bug", SCHEMAS)
    assert text.startswith("<|im_start|>system\nYou are a coding agent")
    assert "<tools>\n" + json.dumps(SCHEMAS[0]) + "\n" in text
    assert text.endswith("<|im_start|>user\nfix the bug<|im_end|>\n<|im_start|>assistant\n")


def test_hermes_parse_round_trip_and_errors():
    fmt = make_format("hermes")
    call = ToolCall("edit", {"path": "a.py", "search": "x", "replace": "y"})
    assert fmt.parse("I will edit.\n" + fmt.render_call(call)) == call
    assert fmt.parse('<tool_call>{"name": "lint", "arguments": "{\\"path\\": \\"a\\"}"}</tool_call>') \
        == ToolCall("lint", {"path": "a"})
    assert fmt.parse('<tool_call>{"name": "finish"}</tool_call>') == ToolCall("finish", {})
    for text, why in [("just text", "no tool call found"), ("<tool_call>{", "not closed"),
                      ("<tool_call>{bad}</tool_call>", "not valid JSON"),
                      ("<tool_call>[1]</tool_call>", "must be a JSON object"),
                      ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
                      ('<tool_call>{"name": "x", "arguments": 3}</tool_call>', "must be a JSON object"),
                      ("<tool_call>{}</tool_call><tool_call>{}</tool_call>", "2 tool calls")]:
        parsed = fmt.parse(text)
        assert isinstance(parsed, BadCall) and why in parsed.reason, text


def test_compact_parse_round_trip_and_errors():
    fmt = make_format("compact")
    for call in [ToolCall("run_tests", {}), ToolCall("read_file", {"path": "a.py", "start_line": 3})]:
        assert fmt.parse("thinking...\n" + fmt.render_call(call)) == call
    for text, why in [("no call", "no tool call"), ("@edit {nope", "not valid JSON"),
                      ("@edit [1]", "must be a JSON object"), ('@think {"thought": "a"}\n@finish', "more than one")]:
        parsed = fmt.parse(text)
        assert isinstance(parsed, BadCall) and why in parsed.reason, text
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        make_format("xml")


def test_compact_prompt_lists_every_tool():
    text = make_format("compact").prompt(ByteTokenizer(), "task", SCHEMAS)
    line = next(x for x in text.splitlines() if x.startswith("Tools: "))
    assert "edit(path, search, replace)" in line
    assert "read_file(path, start_line?, end_line?)" in line
    assert line.count("(") == len(SCHEMAS)
    assert text.endswith("<|user|>\ntask\n<|assistant|>\n")


def test_observation_follows_the_template(qwen_tok):
    ended = observation_text(qwen_tok, "3 passed", action_ended=True)
    assert ended == "\n<|im_start|>user\n<tool_response>\n3 passed\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    cut = observation_text(qwen_tok, "3 passed", action_ended=False)
    assert cut == "<|im_end|>" + ended
    # a context built turn by turn equals the template rendering the whole conversation
    action = make_format("hermes").render_call(ToolCall("run_tests", {}))
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    prompt = qwen_tok.apply_chat_template(messages)
    whole = qwen_tok.apply_chat_template(
        messages + [{"role": "assistant", "content": action}, {"role": "tool", "content": "3 passed"}])
    assert prompt + action + cut == whole
    byte = observation_text(ByteTokenizer(), "ok §", action_ended=True)
    assert byte == "\n<|tool|>\nok §\n<|assistant|>\n"
