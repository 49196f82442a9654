"""The fork-server: a long-lived process that never runs untrusted code.

Protocol on fds 0/1 (frames, see `wire`): the host sends a hello
{"workroot", "preload", "pylib", "isolated", "solution_uid"}; the zygote answers {"ready", "pid"}.
Then per run the host sends {"spec"} (what the solution may see) and a secret
frame {"nonce", "setup", "cases"}. The zygote forks a grader after reading only
the spec, relays the secret frame to it unparsed through a pipe (the grader
reads it after forking the solution, so no solution memory ever held tests or
nonce), waits for the verdict, kills every descendant, wipes the work root and
answers {"verdict_bytes", "reason", "recycle"} followed, when
verdict_bytes > 0, by the grader's verdict frame, relayed unparsed too. A run that
changed the zygote's mount table (it cannot, short of a kernel bug) recycles the sandbox.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import select
import sys
import time

import confine
import grader
import preload
import wire
from cleanup import become_subreaper, kill_descendants, remove_sysv_ipc, wipe

_GRACE_S = 2.0
# The only memory secret frames (tests, nonce) and verdicts pass through here;
# zeroed after each use.
_BUFFER = bytearray(1 << 20)


# keyctl(2) has no libc wrapper; its syscall number depends on the architecture.
_NR_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
_KEYCTL_CLEAR = 7
_KEY_SPECS = (-3, -4, -5)  # session, user, user-session keyrings


def clear_keyrings() -> None:
    """The user keyring outlives processes: empty the ones a run could have written."""
    if _NR_KEYCTL is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for spec in _KEY_SPECS:
        libc.syscall(_NR_KEYCTL, _KEYCTL_CLEAR, spec)


def _mount_table() -> str:
    try:
        with open("/proc/self/mountinfo") as f:
            return f.read()
    except OSError:
        return ""


def _read_verdict(fd: int, deadline: float) -> int | None:
    """Read the grader's verdict frame into _BUFFER; its size, or None on timeout/overflow."""
    view = memoryview(_BUFFER)
    size = 0
    while size < len(_BUFFER):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            break
        got = os.readv(fd, [view[size:]])
        if not got:
            return size
        size += got
    view[:size] = bytes(size)  # a partial verdict is no verdict; leave nothing behind
    return None


def run_one(
    spec: dict, host_in: int, workroot: str, isolated: bool
) -> tuple[dict, int]:
    """One run: (reply for the host, size of the verdict frame now in _BUFFER)."""
    secret_r, secret_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (host_in, secret_w, verdict_r):
                os.close(fd)
            grader.grade(spec, secret_r, verdict_w, os.path.join(workroot, "work"))
        finally:
            os._exit(0)
    os.close(secret_r)
    os.close(verdict_w)
    # Tests and nonce pass through to the grader without ever being parsed here.
    wire.relay(host_in, secret_w, _BUFFER)
    os.close(secret_w)
    size = _read_verdict(
        verdict_r, time.monotonic() + spec["limits"]["wall_s"] + _GRACE_S
    )
    os.close(verdict_r)
    if size is not None:  # EOF on the verdict pipe: the grader is exiting right now
        os.waitpid(pid, 0)
    clean = kill_descendants() & wipe(workroot)
    if isolated:  # never on the host's namespaces (process backend)
        remove_sysv_ipc()
        clear_keyrings()
    reply = {"verdict_bytes": size or 0, "recycle": not clean}
    if size is None:
        reply.update(
            reason="grader did not finish in time (stopped or stuck)", timeout=True
        )
    elif not size:
        reply.update(reason="grader died without a verdict (killed by the solution?)")
    return reply, size or 0


def main() -> None:
    host_in, host_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    # not dumpable: same-uid solutions cannot ptrace us or open /proc/<pid>/fd|mem
    confine.set_dumpable(False)
    become_subreaper()
    hello = wire.recv(host_in)
    for name in hello["preload"]:
        importlib.import_module(name)
    preload.freeze()
    workroot = hello["workroot"]
    pylib = hello["pylib"]
    wire.send(host_out, {"ready": True, "pid": os.getpid()})
    mounts = _mount_table()
    while (msg := wire.recv(host_in)) is not None:
        spec = {**msg["spec"], "pylib": pylib, "solution_uid": hello["solution_uid"]}
        if spec["mode"] == "pytest" and "pytest" not in sys.modules:
            # at the first repository run, so that a zygote grading functions alone (HumanEval)
            # stays as lean as before (see PRELOAD in launchers.py)
            preload.import_pytest(pylib)
            preload.freeze()
        spec.update(files=wire.decode_files(spec["files"]), edits=wire.decode_files(spec["edits"]))
        reply, size = run_one(spec, host_in, workroot, hello["isolated"])
        if _mount_table() != mounts:  # nothing may mount here; if it did, start afresh
            reply.update(recycle=True)
        wire.send(host_out, reply)
        # The verdict (failure messages quote expected values) goes out unparsed, so
        # no later solution forked from here can find it in memory.
        wire.write_all(host_out, memoryview(_BUFFER)[:size])
        _BUFFER[:size] = bytes(size)
        if reply["recycle"]:
            sys.exit(0)  # the host starts a fresh sandbox


if __name__ == "__main__":
    main()
