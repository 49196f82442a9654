"""Plain-data codec for values crossing from the solution to the grader.

`decode` builds only genuine builtin objects (int, float, str, list, ...), so
whatever the solution sends, the grader compares real data: an object whose
`__eq__` always returns True cannot cross the boundary. `encode` runs in the
untrusted process; its hack flag is advisory (a solution can bypass it, but
then the grader just sees an opaque value that equals nothing).
"""

from __future__ import annotations

import base64
import math

_SCALARS = (type(None), bool, int, str)
_BASES = (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)


class HackSuspected(Exception):
    """A returned object overrides equality or subclasses a plain type."""


class Opaque:
    """Stand-in for a value that is not plain data: equal only to itself."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<opaque {self.type_name}>"

    def __bool__(self) -> bool:
        raise TypeError(f"truth value of opaque {self.type_name} is undefined")


def _check_suspicious(value: object) -> None:
    cls = type(value)
    for base in _BASES:
        if isinstance(value, base):
            raise HackSuspected(
                f"result type {cls.__qualname__} subclasses {base.__name__}"
            )
    if cls.__eq__ is not object.__eq__ or cls.__ne__ is not object.__ne__:
        raise HackSuspected(f"result type {cls.__qualname__} overrides equality")


def encode(value: object) -> object:
    cls = type(value)
    if cls in _SCALARS:
        return value
    if cls is float:
        return value if math.isfinite(value) else {"f": repr(value)}
    if cls is list:
        return [encode(v) for v in value]
    if cls is tuple:
        return {"t": [encode(v) for v in value]}
    if cls is dict:
        return {"d": [[encode(k), encode(v)] for k, v in value.items()]}
    if cls is set:
        return {"s": [encode(v) for v in value]}
    if cls is frozenset:
        return {"fs": [encode(v) for v in value]}
    if cls is bytes:
        return {"b": base64.b64encode(value).decode()}
    if cls is complex:
        return {"c": [repr(value.real), repr(value.imag)]}
    if cls.__module__ == "numpy" and hasattr(value, "tolist"):
        return encode(value.tolist())  # numpy scalars/arrays: honest plain data
    _check_suspicious(value)
    return {"o": cls.__qualname__}


def decode(data: object) -> object:
    cls = type(data)
    if cls in _SCALARS or cls is float:
        return data
    if cls is list:
        return [decode(v) for v in data]
    if cls is not dict or len(data) != 1:
        raise ValueError(f"malformed encoded value of type {cls.__name__}")
    ((tag, body),) = data.items()
    if tag == "t":
        return tuple(decode(v) for v in _as_list(body))
    if tag == "d":
        return {decode(k): decode(v) for k, v in _pairs(body)}
    if tag == "s":
        return {decode(v) for v in _as_list(body)}
    if tag == "fs":
        return frozenset(decode(v) for v in _as_list(body))
    if tag == "f":
        return float(_as_str(body))
    if tag == "b":
        return base64.b64decode(_as_str(body))
    if tag == "c":
        re_, im = _as_list(body)
        return complex(float(_as_str(re_)), float(_as_str(im)))
    if tag == "o":
        return Opaque(_as_str(body))
    raise ValueError(f"unknown tag {tag!r}")


def _as_list(body: object) -> list:
    if type(body) is not list:
        raise ValueError("expected a list")
    return body


def _as_str(body: object) -> str:
    if type(body) is not str:
        raise ValueError("expected a string")
    return body


def _pairs(body: object) -> list:
    pairs = _as_list(body)
    if any(type(p) is not list or len(p) != 2 for p in pairs):
        raise ValueError("expected key/value pairs")
    return pairs
