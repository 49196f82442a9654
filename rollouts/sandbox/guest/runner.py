"""The solution side of a run: executes untrusted code and answers calls.

Everything here runs in the untrusted process, so nothing here is relied on
for the verdict: the grader checks every reply (see `codec`). Replies are
["ready"], ["ok", value], ["raise", type, message], ["hack", why], ["oom", why].
"""

from __future__ import annotations

import builtins
import importlib
import operator
import os
import socket
import sys
from collections.abc import Callable

import codec
import wire

_MESSAGE_CHARS = 500


def _attempt(thunk: Callable[[], object]) -> list:
    try:
        return _classify(thunk)
    finally:  # the process is SIGKILLed after the last reply: flush what it printed
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass


def _classify(thunk: Callable[[], object]) -> list:
    try:
        return ["ok", thunk()]
    except codec.HackSuspected as e:
        return ["hack", str(e)]
    except MemoryError:
        return ["oom", "MemoryError"]
    except Exception as e:  # the solution's own error: a failed test, not ours
        return ["raise", type(e).__name__, str(e)[:_MESSAGE_CHARS]]
    except SystemExit:
        return ["hack", "solution raised SystemExit (sys.exit/exit/quit)"]
    except (
        BaseException
    ) as e:  # KeyboardInterrupt or custom: an attempt to abort the harness
        return ["hack", f"solution raised {type(e).__name__}"]


def _load(program: str, entry_point: str) -> tuple[list, Callable | None]:
    namespace: dict = {"__name__": "solution", "__builtins__": builtins}
    reply = _attempt(lambda: exec(compile(program, "solution.py", "exec"), namespace))
    if reply[0] != "ok":
        return reply, None
    fn = namespace.get(entry_point)
    if not callable(fn):
        return [
            "raise",
            "NameError",
            f"entry point {entry_point!r} is not defined",
        ], None
    return ["ready"], fn


def serve(sock: socket.socket, program: str, entry_point: str) -> None:
    reply, fn = _load(program, entry_point)
    wire.send_sock(sock, reply)
    if fn is None:
        return
    while (call := wire.recv_with(sock.recv)) is not None:
        args = codec.decode(call["args"])
        kwargs = codec.decode(call["kwargs"])
        reply = _attempt(lambda a=args, k=kwargs: codec.encode(fn(*a, **k)))
        wire.send_sock(sock, reply)


def harness_pytest(args: list[str], root: str, pylib: list[str]) -> list[str]:
    """Set this process up for a pytest run the harness alone configures, over the tests
    under `root`; its argv. Both pytest modes (here and in the grader) run this way."""
    sys.path[:] = [*sys.path, *pylib, root]
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    harness = os.path.dirname(os.path.abspath(__file__))
    return [*args, "-c", os.path.join(harness, "pytest.ini"), "--rootdir", root,
            "--confcutdir", root, "--import-mode=append", "-p", "no:cacheprovider", "-q"]  # fmt: skip


def run_pytest(sock: socket.socket, args: list[str], pylib: list[str]) -> None:
    """Run pytest in this process (it imports the solution) with the reporting plugin,
    configured by the harness alone: its own ini file, no plugin autoloading (a
    `*.dist-info` in the repository cannot register one), and the repository after the
    standard library, the harness and pytest on sys.path (a root `inspect.py` or
    `pytest_verdict.py` shadows nothing)."""
    root = os.getcwd()
    argv = harness_pytest(args, root, pylib)
    loaded = _attempt(lambda: importlib.import_module("pytest"))
    if loaded[0] != "ok":
        wire.send_sock(
            sock, ["raise", "ImportError", "pytest is not available in the sandbox"]
        )
        return
    import pytest_verdict

    pytest = loaded[1]
    plugin = pytest_verdict.Reporter(sock)
    reply = _attempt(lambda: int(pytest.main(argv, plugins=[plugin])))
    wire.send_sock(sock, ["done", reply[1]] if reply[0] == "ok" else reply)


# ---- isolated repository grading: the solution's modules served as remote objects ----
# Requests (from the grader's proxies, see `proxy`): ["import", name], ["getattr", ref, name],
# ["setattr", ref, name, value], ["call", ref, args, kwargs], ["op", ref, dunder, args],
# ["next", ref]. Values cross as plain data (codec) when they are, else as a handle:
# ["ref", id, kind, qualname, module, base], kind in module/class/exception/function/object;
# base: an exception class's nearest builtin ancestor. Handles sent back are {"ref": id}.
_OPS = {"__len__": len, "__bool__": bool, "__iter__": iter, "__contains__": lambda t, x: x in t,
        "__getitem__": operator.getitem, "__setitem__": operator.setitem,
        "__delitem__": operator.delitem, "__eq__": operator.eq, "__ne__": operator.ne,
        "__lt__": operator.lt, "__le__": operator.le, "__gt__": operator.gt, "__ge__": operator.ge,
        "__hash__": hash, "__str__": str, "__repr__": repr, "__enter__": lambda t: type(t).__enter__(t),
        "__exit__": lambda t, *exc: type(t).__exit__(t, *exc), "__add__": operator.add,
        "__sub__": operator.sub, "__mul__": operator.mul, "__truediv__": operator.truediv,
        "__floordiv__": operator.floordiv, "__mod__": operator.mod, "__neg__": operator.neg}  # fmt: skip
_PLAIN = (type(None), bool, int, float, str, bytes, complex)


def _is_plain(value: object, depth: int = 0) -> bool:
    cls = type(value)
    if cls in _PLAIN:
        return True
    if depth > 50:
        return False
    if cls in (list, tuple, set, frozenset):
        return all(_is_plain(v, depth + 1) for v in value)
    if cls is dict:
        return all(_is_plain(k, depth + 1) and _is_plain(v, depth + 1) for k, v in value.items())
    return False


class _Objects:
    def __init__(self):
        self.table: dict[int, object] = {}

    def export(self, value: object) -> list:
        if _is_plain(value):
            return ["v", codec.encode(value)]
        ref = id(value)
        self.table[ref] = value  # kept alive for the run: the grader may come back to it
        cls = value if isinstance(value, type) else type(value)
        if isinstance(value, type) and issubclass(value, BaseException):
            base = next(c.__name__ for c in value.__mro__ if c.__module__ == "builtins")
            kind = "exception"
        else:
            base = ""
            kind = ("module" if type(value).__name__ == "module" else "class" if isinstance(value, type)
                    else "function" if callable(value) else "object")  # fmt: skip
        name = value.__name__ if kind == "module" else cls.__qualname__
        return ["ref", ref, kind, name, getattr(cls, "__module__", ""), base]

    def resolve(self, data: object) -> object:
        if type(data) is dict and set(data) == {"ref"}:
            return self.table[data["ref"]]
        if type(data) is list:
            return [self.resolve(v) for v in data]
        if type(data) is dict and len(data) == 1 and "t" in data:  # a tuple of handles
            return tuple(self.resolve(v) for v in data["t"])
        return codec.decode(data)

    def handle(self, req: list) -> object:
        kind = req[0]
        if kind == "import":
            return importlib.import_module(req[1])
        target = self.table[req[1]]
        if kind == "getattr":
            return getattr(target, req[2])
        if kind == "setattr":
            setattr(target, req[2], self.resolve(req[3]))
            return None
        if kind == "call":
            return target(*self.resolve(req[2]), **dict(zip(req[3][0], self.resolve(req[3][1]))))
        if kind == "op" and req[2] in _OPS:  # as Python applies it (len for bool, ...)
            return _OPS[req[2]](target, *self.resolve(req[3]))
        if kind == "next":
            return ["next", self.export(next(target))]
        raise ValueError(f"unknown request {kind!r}")


def _answer(objects: _Objects, req: list) -> list:
    try:
        result = objects.handle(req)
    except StopIteration:
        return ["stop"]
    except SystemExit:
        return ["hack", "solution raised SystemExit (sys.exit/exit/quit)"]
    except MemoryError:
        return ["oom", "MemoryError"]
    except BaseException as e:  # the solution's own error, re-raised in the test
        if not isinstance(e, Exception):
            return ["hack", f"solution raised {type(e).__name__}"]
        return ["raise", objects.export(type(e)), str(e)[:_MESSAGE_CHARS]]
    if type(result) is list and result[:1] == ["next"]:
        return ["ok", result[1]]
    return ["ok", objects.export(result)]


def serve_objects(sock: socket.socket) -> None:
    """Answer the grader's requests on the repository's modules until it hangs up."""
    sys.path[:] = [*sys.path, os.getcwd()]  # the repository after the standard library
    objects = _Objects()
    wire.send_sock(sock, ["ready"])
    while (req := wire.recv_with(sock.recv)) is not None:
        reply = _attempt(lambda r=req: _answer(objects, r))
        wire.send_sock(sock, reply[1] if reply[0] == "ok" else reply)
