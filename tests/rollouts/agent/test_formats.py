"""Tool-call formats: Hermes with a Qwen2.5 chat template, compact for the byte model."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jaxagent.tokenizer import ByteTokenizer, HFTokenizer
from rollouts.agent import BadCall, ToolCall, make_format, observation_text
from rollouts.tools import TOOLS, Toolbox

# Qwen2.5's tool-calling chat template (the parts these tests exercise).
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_tok")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(["<tool_call> def f(x): return x\n"] * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": QWEN_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return HFTokenizer(path)


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
    assert "  edit(path: string, search: string, replace: string) - Replace one" in text
    assert "  read_file(path: string, start_line?: integer, end_line?: integer)" in text
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
