"""The compact call grammar: what it accepts is exactly the canonical calls that parse and
pass the tools' argument checks, and a broken call is cut at its first wrong byte."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from jaxagent.tokenizer import ByteTokenizer
from rollouts.agent import BadCall, ToolCall, make_format
from rollouts.agent.grammar import CallGrammar
from rollouts.tools import TOOLS, Toolbox
from rollouts.tools.core import Param, Tool, ToolError

TOK = ByteTokenizer()
FMT = make_format("compact")
# a boolean and an enum beside the built-in tools (none of which has a boolean)
FLAG = Tool("flag", "set a flag", (Param("on", "boolean", "on?"),
                                   Param("level", "string", "how much", False, ("low", "high"))),
            lambda ctx, **kw: "")
ALL = (*TOOLS, FLAG)
GRAMMAR = CallGrammar(ALL)
BOX = Toolbox(ALL)


def action(text: str, stop: bool = True) -> list[int]:
    return TOK.encode(text) + ([TOK.eos_id] if stop else [])


def refused_at(text: str, stop: bool = True) -> int | None:
    """The index of the first refused token (None: none refused)."""
    allowed = GRAMMAR.off_grammar(action(text, stop), TOK.stop_ids, TOK.vocab_size)
    return None if allowed is None else len(allowed) - 1


def random_call(rng: random.Random) -> ToolCall:
    tool = rng.choice(ALL)
    params = [p for p in tool.params if p.required or rng.random() < 0.5]
    rng.shuffle(params)  # json.dumps keeps the dict's order: any order is well-formed
    args = {}
    for p in params:
        if p.enum:
            args[p.name] = rng.choice(p.enum)
        elif p.type == "string":
            chars = 'ab\n"\\/é\u2603 \t{}:,@'
            args[p.name] = "".join(rng.choice(chars) for _ in range(rng.randint(0, 9)))
        elif p.type == "integer":
            args[p.name] = rng.choice([0, 7, -3, 120, rng.randint(-10**6, 10**6)])
        else:
            args[p.name] = rng.random() < 0.5
    return ToolCall(tool.name, args)


def parses_and_checks(text: str) -> bool:
    call = FMT.parse(text)
    if isinstance(call, BadCall) or call.name not in BOX.tools:
        return False
    try:
        BOX.tools[call.name].check_args(call.args)
    except ToolError:
        return False
    return True


def test_every_rendered_call_is_accepted_to_its_stop():
    rng = random.Random(0)
    for _ in range(300):
        text = FMT.render_call(random_call(rng))
        assert refused_at(text) is None, text
        assert parses_and_checks(text)


def test_accepted_mutations_parse_and_pass_the_argument_checks():
    """A byte inserted, deleted or replaced in a rendered call: when the grammar accepts the
    result it is a call the tools take; when the result is a canonical call the tools take
    (it renders back to itself), the grammar accepts it."""
    rng = random.Random(1)
    alphabet = '@ {}":,0123456789-abtruefalspnhi_\\'
    accepted = refused = 0
    for _ in range(3000):
        text = FMT.render_call(random_call(rng))
        i = rng.randrange(len(text) + 1)
        how = rng.choice("idr")
        c = rng.choice(alphabet)
        text = text[:i] + c + text[i:] if how == "i" else (
            text[:i] + text[i + 1:] if how == "d" else text[:i] + c + text[i + 1:])
        ok = refused_at(text) is None
        accepted += ok
        refused += not ok
        if ok:
            assert parses_and_checks(text), text
        elif parses_and_checks(text):
            call = FMT.parse(text)
            assert FMT.render_call(call) != text, text
    assert accepted > 100 and refused > 1000  # both sides exercised


@pytest.mark.parametrize("text, stop, where", [
    ("@read_fle", True, 7),  # no tool starts "read_fl"
    ('@read_file {"path": "a.py"', True, 26),  # stopped inside the object
    ('@replace_line {"path": "a", "text": "x"}', True, 39),  # "line" is required
    ('@read_file {"path": "a", "path": "b"}', True, 26),  # a key twice: "p" refused
    ('@read_file {"path": 3}', True, 20),  # a string parameter
    ('@read_file {"path":"a"}', True, 19),  # json.dumps spacing
    ('@read_file {"start_line": 01, "path": "a"}', True, 27),  # no leading zeros
    ('@search {"query": "x", "mode": "regexp"}', True, 37),  # not an enum value
    ('@flag {"on": tru}', True, 16),
    ('@run_tests {}', True, 12),  # no arguments: no object
    ("@finish\n", True, 7),
    ("\n@finish", True, 0),  # a call starts with @
    ("@finish", True, None),
    ('@run_tests {"test": "tests/test_a.py::t"}', True, None),
    ('@flag {"on": false, "level": "high"}', True, None),
    ('@read_file {"path": "a\\u00e9b"}', True, None),
    ('@read_file {"path": "a\\u00g', True, 26),  # not a hex digit
    ('@replace_line {"path": "a", "line": -0', False, None),  # cut short, well-formed so far
])
def test_the_first_refused_token(text, stop, where):
    assert refused_at(text, stop) == where


def test_allowed_sets_along_a_call():
    tokens = action('@read_file {"pth"')
    allowed = GRAMMAR.off_grammar(tokens, TOK.stop_ids, TOK.vocab_size)
    assert allowed.shape == (15, TOK.vocab_size)  # '"p' then 't' is refused
    assert np.flatnonzero(allowed[0]).tolist() == [ord("@")]
    # after "@r": the tools that start with r (read_file, replace_line, run_tests)
    assert sorted(np.flatnonzero(allowed[2]).tolist()) == sorted(map(ord, "eu"))
    assert np.flatnonzero(allowed[14]).tolist() == [ord("a")]  # "pa" (path), not "pt"
    assert not allowed[:, TOK.bos_id].any() and not allowed[:, TOK.pad_id].any()
    done = GRAMMAR.off_grammar(action("@finish {"), TOK.stop_ids, TOK.vocab_size)
    # "@finish" may stop; once its object opens it may not
    assert done.shape[0] == 10 and done[7, TOK.eos_id] and not done[9, TOK.eos_id]
    # a model's vocabulary padded past the tokenizer's samples ids it has no bytes for
    padded = GRAMMAR.off_grammar(action("@fin", stop=False) + [TOK.vocab_size + 4], TOK.stop_ids,
                                 TOK.vocab_size)
    assert padded.shape == (5, TOK.vocab_size) and padded[4, ord("i")]
    stop_ok = GRAMMAR.off_grammar(action('@finish {"summary": "x"}}'), TOK.stop_ids, TOK.vocab_size)
    assert stop_ok.shape[0] == 25 and np.flatnonzero(stop_ok[24]).tolist() == [TOK.eos_id]


def test_the_builtin_schemas_are_what_the_grammar_reads():
    # a tool whose parameters are all optional may stop after its name, one with any
    # required may not; json.dumps of its arguments opens with '{"'
    for tool in TOOLS:
        tokens = action(f"@{tool.name}", stop=False) + [ord("?")]
        allowed = GRAMMAR.off_grammar(tokens, TOK.stop_ids, TOK.vocab_size)
        last = allowed[-1]
        assert last[TOK.eos_id] == all(not p.required for p in tool.params), tool.name
        assert last[ord(" ")] == bool(tool.params), tool.name
        rendered = json.dumps({p.name: 1 for p in tool.params})
        assert rendered.startswith('{"') or not tool.params


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A byte-level BPE learnt from rendered calls, so call names and keys are whole tokens
    (`@`, `read`, `_file`, ...)."""
    from jaxagent.tokenizer import train_bpe

    rng = random.Random(2)
    texts = [FMT.render_call(random_call(rng)) for _ in range(400)]
    return train_bpe(texts, 400, tmp_path_factory.mktemp("bpe"))


def test_a_bpe_token_is_allowed_exactly_where_its_bytes_are(bpe):
    """Under a learnt BPE, calls and their one-byte mutations: the BPE grammar refuses a call
    exactly when the byte grammar does, at the token holding the first refused byte, and at
    every position before it allows exactly the tokens whose bytes the byte grammar takes."""
    grammar = CallGrammar(ALL, bpe.token_bytes())
    pieces = bpe.token_bytes()
    assert sum(p is not None and len(p) > 1 for p in pieces) > 50  # merges, not bytes alone
    rng = random.Random(3)
    refused_calls = 0
    for n in range(400):
        text = FMT.render_call(random_call(rng))
        if n % 2:
            i, c = rng.randrange(len(text)), rng.choice('@ {}":,0123456789abe_')
            text = text[:i] + c + text[i + 1:]
        ids = bpe.encode(text) + [bpe.eos_id]
        allowed = grammar.off_grammar(ids, bpe.stop_ids, bpe.vocab_size)
        byte_at = refused_at(text)
        if byte_at is None:
            assert allowed is None, text
            continue
        refused_calls += 1
        ends = np.cumsum([len(pieces[i] or b"-") for i in ids])  # the stop: one place, as in bytes
        assert len(allowed) - 1 == int(np.searchsorted(ends, byte_at, side="right")), text
        for k in rng.sample(range(len(allowed)), min(3, len(allowed))):
            before = list(b"".join(pieces[i] for i in ids[:k]))  # byte ids, cut mid-character too
            for t in rng.sample(range(bpe.vocab_size), 40):
                piece = pieces[t]
                if piece is None or t in bpe.stop_ids:
                    continue
                takes = GRAMMAR.off_grammar(before + list(piece), TOK.stop_ids,
                                            TOK.vocab_size) is None
                assert allowed[k, t] == takes, (text, k, piece)
    assert refused_calls > 100


def test_read_line_is_refused_at_its_line_token(bpe):
    grammar = CallGrammar(ALL, bpe.token_bytes())
    ids = bpe.encode('@read_line {"path": "a"}') + [bpe.eos_id]
    pieces = bpe.token_bytes()
    allowed = grammar.off_grammar(ids, bpe.stop_ids, bpe.vocab_size)
    cut = b"".join(pieces[i] for i in ids[:len(allowed) - 1])
    assert cut.startswith(b"@read") and len(cut) <= len(b"@read_")
    assert allowed[-1, bpe.encode("_file")[0]] or allowed[-1, bpe.encode("file")[0]]
