"""The solution side of a run: executes untrusted code and answers calls.

Everything here runs in the untrusted process, so nothing here is relied on
for the verdict: the grader checks every reply (see `codec`). Replies are
["ready"], ["ok", value], ["raise", type, message], ["hack", why], ["oom", why].
"""

from __future__ import annotations

import builtins
import importlib
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


def run_pytest(sock: socket.socket, args: list[str], pylib: list[str]) -> None:
    """Run pytest in this process (it imports the solution) with the reporting plugin,
    configured by the harness alone: its own ini file, no plugin autoloading (a
    `*.dist-info` in the repository cannot register one), and the repository after the
    standard library, the harness and pytest on sys.path (a root `inspect.py` or
    `pytest_verdict.py` shadows nothing)."""
    root = os.getcwd()
    sys.path[:] = [*sys.path, *pylib, root]
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    loaded = _attempt(lambda: importlib.import_module("pytest"))
    if loaded[0] != "ok":
        wire.send_sock(
            sock, ["raise", "ImportError", "pytest is not available in the sandbox"]
        )
        return
    import pytest_verdict

    pytest = loaded[1]
    plugin = pytest_verdict.Reporter(sock)
    harness = os.path.dirname(os.path.abspath(__file__))
    argv = [*args, "-c", os.path.join(harness, "pytest.ini"), "--rootdir", root,
            "--confcutdir", root, "--import-mode=append", "-p", "no:cacheprovider", "-q"]  # fmt: skip
    reply = _attempt(lambda: int(pytest.main(argv, plugins=[plugin])))
    wire.send_sock(sock, ["done", reply[1]] if reply[0] == "ok" else reply)
