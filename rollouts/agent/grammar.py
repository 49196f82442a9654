"""The compact call format as a byte automaton: which next tokens keep an action a well-formed
call of one of the episode's tools (a token is allowed where every byte it writes is).

A well-formed action is what the demonstrations write, `CompactFormat.render_call` then the
stop token: `@name` (a tool whose parameters are all optional), or `@name {"key": value, ...}`
with `json.dumps` spacing, each key one of the tool's parameters at most once, every required
one present, each value of its parameter's type (a JSON string, one of its enum values, an
integer or a boolean). Every action the automaton accepts parses to a call that
`Tool.check_args` takes (tested).

The grammar teacher of targeted feedback (`agent.feedback_teacher: grammar`) uses it at a
flagged turn: at each of the turn's bytes up to the first one the automaton refuses, the
teacher is the policy itself restricted to the tokens allowed there (`jaxagent.rl.feedback.
allowed_kl`), so the correction lowers only the mass on tokens that break the call. Under a
byte-level BPE a token such as `_line` after `@read` is refused whole.

States are small tuples (hashable), so each state's allowed set is computed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np

from rollouts.tools.core import Tool

_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")


def _extend(prefix: str, c: int, words) -> str | None:
    """`prefix` and byte `c`, if that still begins one of `words`; else None."""
    longer = prefix + chr(c)
    return longer if any(w.startswith(longer) for w in words) else None


class CallGrammar:
    """The automaton over bytes for the compact calls of `tools`."""

    START = ("start",)
    DONE = ("done",)

    def __init__(self, tools: Sequence[Tool], token_bytes: Sequence[bytes | None] | None = None):
        """`token_bytes[i]`: the bytes token i writes, None for a special token (a
        tokenizer's `token_bytes()`); by default the byte tokenizer's ids 0..255."""
        self.params = {t.name: {p.name: p for p in t.params} for t in tools}
        self.required = {t.name: frozenset(p.name for p in t.params if p.required) for t in tools}
        self.token_bytes = (list(token_bytes) if token_bytes is not None
                            else [bytes([b]) for b in range(256)])
        self.allowed_tokens = cache(self._allowed_tokens)

    def accepts(self, state) -> bool:
        """Whether the call may end here (the stop token is allowed)."""
        if state == self.DONE:
            return True
        return state[0] == "name" and state[1] in self.params and not self.required[state[1]]

    def step(self, state, c: int):
        """The state after byte `c`, or None where `c` breaks the call."""
        kind = state[0]
        if kind == "start":
            return ("name", "") if c == ord("@") else None
        if kind == "name":
            name = state[1]
            if c == ord(" ") and name in self.params and self.params[name]:
                return ("open", name)
            longer = _extend(name, c, self.params)
            return ("name", longer) if longer is not None else None
        if kind == "open":
            return ("key?", state[1], frozenset()) if c == ord("{") else None
        if kind == "key?":
            tool, used = state[1:]
            return ("key", tool, used, "") if c == ord('"') else None
        if kind == "key":
            tool, used, key = state[1:]
            unused = [k for k in self.params[tool] if k not in used]
            if c == ord('"'):
                return ("colon", tool, used, key) if key in unused else None
            longer = _extend(key, c, unused)
            return ("key", tool, used, longer) if longer is not None else None
        if kind == "colon":
            return ("space", *state[1:]) if c == ord(":") else None
        if kind == "space":
            tool, used, key = state[1:]
            return ("value", tool, used | {key}, key) if c == ord(" ") else None
        if kind == "value":
            return self._value(state[1], state[2], self.params[state[1]][state[3]], c)
        if kind == "str":
            return self._string(state, c)
        if kind == "enum":
            tool, used, key, text = state[1:]
            values = self.params[tool][key].enum
            if c == ord('"'):
                return ("after", tool, used) if text in values else None
            longer = _extend(text, c, values)
            return ("enum", tool, used, key, longer) if longer is not None else None
        if kind == "int":
            tool, used, digits = state[1:]
            if c in _DIGITS and digits != "0":  # "0": a leading zero ends the digits
                return ("int", tool, used, "0" if digits == "-" and c == ord("0") else "1")
            return None if digits == "-" else self.step(("after", tool, used), c)
        if kind == "literal":
            tool, used, rest = state[1:]
            if c != ord(rest[0]):
                return None
            return ("literal", tool, used, rest[1:]) if rest[1:] else ("after", tool, used)
        if kind == "after":
            tool, used = state[1:]
            if c == ord(",") and set(self.params[tool]) - used:
                return ("comma", tool, used)
            return self.DONE if c == ord("}") and self.required[tool] <= used else None
        if kind == "comma":
            return ("key?", *state[1:]) if c == ord(" ") else None
        return None  # DONE: nothing after the closing brace but the stop token

    def _value(self, tool: str, used: frozenset, param, c: int):
        if param.type == "string":
            if c != ord('"'):
                return None
            return ("enum", tool, used, param.name, "") if param.enum else ("str", tool, used, "")
        if param.type == "integer":
            if c == ord("-"):
                return ("int", tool, used, "-")
            return ("int", tool, used, "0" if c == ord("0") else "1") if c in _DIGITS else None
        literal = next((w for w in ("true", "false") if ord(w[0]) == c), None)
        return ("literal", tool, used, literal[1:]) if literal else None

    @staticmethod
    def _string(state, c: int):
        # escape: "" outside one, "\\" after a backslash, "uN" inside \\u with N hex digits left
        tool, used, escape = state[1:]
        if escape == "\\":
            if c == ord("u"):
                return ("str", tool, used, "u4")
            return ("str", tool, used, "") if c in _ESCAPES else None
        if escape:
            left = int(escape[1]) - 1
            return ("str", tool, used, f"u{left}" if left else "") if c in _HEX else None
        if c == ord('"'):
            return ("after", tool, used)
        if c == ord("\\"):
            return ("str", tool, used, "\\")
        return None if c < 0x20 else state

    def walk(self, state, data: bytes):
        """The state after the bytes `data`, or None where one of them breaks the call."""
        for c in data:
            state = self.step(state, c)
            if state is None:
                return None
        return state

    def _allowed_tokens(self, state) -> np.ndarray:
        return np.asarray([i for i, data in enumerate(self.token_bytes)
                           if data and self.walk(state, data) is not None], np.int64)

    def off_grammar(self, action: Sequence[int], stop_ids: Sequence[int], vocab_size: int):
        """For an action of token ids: the allowed tokens [n, vocab_size] (bool) at its first
        n tokens, where token n-1 is the first the automaton refuses (one with a byte that
        breaks the call, a stop before the call is complete, a special token, an id of the
        model's padded vocabulary past `vocab_size`); None when it refuses none (a
        well-formed call, or a well-formed start cut short)."""
        state, rows = self.START, []
        for token in action:
            row = np.zeros(vocab_size, bool)
            allowed = self.allowed_tokens(state)
            row[allowed[allowed < vocab_size]] = True
            if self.accepts(state):
                row[list(stop_ids)] = True
            rows.append(row)
            if token >= vocab_size or not row[token]:  # an id past the tokenizer's: refused
                return np.stack(rows)
            if token in stop_ids:
                return None  # the call is complete
            state = self.walk(state, self.token_bytes[token])
        return None
