"""A bwrap session's command server: one sandbox for the whole session, each command a fork.

Started in the session's sandbox (the work dir bound at /work, the cwd); it never runs
untrusted code itself. Protocol on fds 0/1 (frames, see `wire`): the host sends a hello
{"limits": a types.Limits dict with "solution_uid", "pylib": [...]}; the server imports pytest
from `pylib` once (~0.12 s of every `python -m pytest` on a 2-core VM), with the plugins
each run loads, freezes what it holds out of its forks' garbage collections (guest/preload.py)
and answers {"ready"}.
Then per command {"argv", "pytest", "timeout_s", "output_bytes"}: a forked child confines
itself and applies the limits as guest/limited.py does, then becomes `argv`, or, with
"pytest", runs `python -m pytest ARGV` in itself, as that command would (the cwd first on
sys.path, pytest's `__main__`, its exit status). The server relays the child's output
(stdout and stderr interleaved, the first output_bytes of it kept, the rest counted) until it
exits or its time is up, then kills whatever it left (we are a subreaper), empties /tmp and
/dev/shm and removes SysV IPC objects, as a fresh sandbox per command would have them, and
answers {"exit_code" (128 + N when signal N ended it; None on a timeout), "timed_out",
"output" (latin-1, byte for byte), "output_bytes", "clean"}. Not clean: the host starts a
fresh sandbox. The child cannot read or signal us: it is another uid (as root) and we are not
dumpable; without root, killing us fails the command and the host restarts the server.
"""

from __future__ import annotations

import os
import runpy
import select
import sys
import time

import limited
import preload
import wire
from cleanup import become_subreaper, kill_descendants, remove_sysv_ipc, wipe
from confine import set_dumpable

# the harness's modules: a repository's own `wire.py` imports as itself, not as ours
_HARNESS_MODULES = ("cleanup", "confine", "limited", "preload", "wire")


def _child(request: dict, limits: dict, out: int) -> None:
    os.setsid()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.closerange(3, 1 << 16)  # the host channel, the pipe's ends
    code = 1
    try:
        if not request["pytest"]:
            limited.run(limits, request["argv"])  # execs
        limited.restrict(limits)
        # what `python -m pytest` sees: the cwd first on sys.path, not the harness's modules
        harness = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [os.getcwd(), *(p for p in sys.path if p != harness)]
        for name in _HARNESS_MODULES:
            sys.modules.pop(name, None)
        sys.argv = ["pytest", *request["argv"]]
        # pytest's own `__main__`, as `python -m pytest` runs it (console_main warns from 9.1)
        runpy.run_module("pytest", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException as e:  # noqa: BLE001 - the command did not start, or pytest broke
        os.write(2, f"{request['argv'][:1]}: {type(e).__name__}: {e}\n".encode())
        code = 1 if request["pytest"] else 127
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream: nothing to save
                pass
        os._exit(code)


def _relay(fd: int, kept: bytearray, cap: int) -> int:
    """Read what `fd` holds, keeping up to `cap` bytes in `kept`; bytes read (0 at its end)."""
    data = os.read(fd, 1 << 16)
    kept += data[: max(0, cap - len(kept))]
    return len(data)


def run_one(request: dict, limits: dict) -> dict:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(request, limits, write_end)
    os.close(write_end)
    exited = os.pidfd_open(pid)
    deadline = time.monotonic() + request["timeout_s"]
    kept, total, code = bytearray(), 0, None
    while (left := deadline - time.monotonic()) > 0:
        ready = select.select([read_end, exited], [], [], left)[0]
        if read_end in ready:
            got = _relay(read_end, kept, request["output_bytes"])
            total += got
            if got:
                continue
            # its output closed: wait for the exit alone
            ready = select.select([exited], [], [], max(0.0, deadline - time.monotonic()))[0]
        if exited in ready:
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            break
        if ready == []:
            break
    os.close(exited)
    clean = kill_descendants()  # the command too, on a timeout
    while clean and (got := _relay(read_end, kept, request["output_bytes"])):  # no writer left
        total += got
    os.close(read_end)
    clean &= all(wipe(d) for d in ("/tmp", "/dev/shm") if os.path.isdir(d))
    remove_sysv_ipc()
    if code is not None and code < 0:
        code = 128 - code
    return {"exit_code": code, "timed_out": code is None, "output": kept.decode("latin-1"),
            "output_bytes": total, "clean": clean}


def main() -> None:
    host_in, host_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    set_dumpable(False)
    become_subreaper()
    hello = wire.recv(host_in)
    sys.path.extend(hello["pylib"])
    preload.import_pytest([])  # once here, forked into every command
    preload.freeze()

    wire.send(host_out, {"ready": True, "pid": os.getpid()})
    while (request := wire.recv(host_in)) is not None:
        reply = run_one(request, hello["limits"])
        wire.send(host_out, reply)
        if not reply["clean"]:
            sys.exit(0)


if __name__ == "__main__":
    main()
