"""The long-lived container of a docker session: its pid 1, each command's entry, the cleanup.

    session_container.py init LIFELINE               pid 1: reap orphans until the host goes
    session_container.py run TOKEN_FILE TOKEN LIMITS_JSON ARGV...   one command, then clean
    session_container.py clean                       the host's, when `run` did not report it

Everything runs as the session's uid. Pid 1 cannot be killed from inside its pid namespace
(the kernel drops every signal it has no handler for) and is not dumpable, so commands can
neither end nor trace it; it holds the read end of a host FIFO (LIFELINE) and exits when the
host's end closes, which ends the container (`--rm` removes it) even when the host process
dies without closing the session. `clean` kills every process but pid 1 and itself
(kill(-1) holds the task list while it signals, so nothing can fork past it), empties /tmp
and /dev/shm and removes SysV IPC objects, as a fresh container per command would have them.
`run` execs its command only while TOKEN_FILE (the host's, read-only here) holds TOKEN: the
host changes it before each cleanup, so a `docker exec` that the engine starts late, after
its command timed out and was cleaned up, runs nothing.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

CLEANED = b"session_container.py: cleaned\n"  # run's report to the host, see run
_CLEAN_S = 5.0  # SIGKILLed processes die in milliseconds; a stuck one fails the cleanup


def init(lifeline: str) -> None:
    from cleanup import reap
    from confine import set_dumpable

    set_dumpable(False)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Python's own handler would let it through
    signal.signal(signal.SIGCHLD, lambda *_: reap())  # orphans reparent to pid 1
    # Not blocking in the open, which would wait forever for a host that died before it;
    # a blocking read then ends at once if it did, else when its end closes.
    fd = os.open(lifeline, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(fd, True)
    while os.read(fd, 4096):  # only EOF counts: the host never writes
        pass


def run(token_file: str, token: str, limits: str, argv: list[str]) -> int:
    """The command's exit code (128 + N when signal N ended it). Its output is relayed to
    our stdout until it exits (a process it left in the background must not hold the
    engine's stream open: the engine would wait for it, 2 s, before it reports the exit);
    then `clean`, and CLEANED on our stderr, which no command can reach (its stdout and
    stderr are the relay's pipe; we are not dumpable, so our fds stay ours) when that
    succeeded: without it the host cleans up itself."""
    import limited
    from confine import set_dumpable

    with open(token_file) as f:
        if f.read() != token:
            raise SystemExit("session_container.py: a revoked command, not run")
    set_dumpable(False)  # see init
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.dup2(write_end, 1)
        os.dup2(write_end, 2)
        os.close(read_end)
        os.close(write_end)
        try:
            limited.run(json.loads(limits), argv)
        except BaseException as e:  # noqa: BLE001 - the command's, not ours: it did not start
            os.write(2, f"{argv[0]}: {e}\n".encode())
        os._exit(127)
    os.close(write_end)
    exited = os.pidfd_open(pid)
    while exited not in select.select([read_end, exited], [], [])[0]:
        if not _relay(read_end):  # nothing holds the pipe now: wait for the exit alone
            break
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    cleaned = clean() == 0
    while _relay(read_end):  # to its end: every writer is dead now
        pass
    if cleaned:
        os.write(2, CLEANED)
    return code if code >= 0 else 128 - code


def _relay(fd: int) -> bool:
    """Copy what `fd` holds to stdout; False at its end."""
    data = os.read(fd, 1 << 16)
    view = memoryview(data)
    while view:
        view = view[os.write(1, view) :]
    return bool(data)


def clean() -> int:
    """0 once nothing of the last command remains; 1 if a process or file resists."""
    from cleanup import remove_sysv_ipc, wipe

    deadline = time.monotonic() + _CLEAN_S
    while True:
        try:
            os.kill(-1, signal.SIGKILL)  # zombies count until pid 1 reaps them
        except ProcessLookupError:
            break
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.001)
    wiped = all(wipe(d) for d in ("/tmp", "/dev/shm") if os.path.isdir(d))
    remove_sysv_ipc()
    return 0 if wiped else 1


def main(args: list[str]) -> int:
    mode = args[0] if args else ""
    if mode == "init" and len(args) == 2:
        init(args[1])
    elif mode == "run" and len(args) >= 5:
        return run(args[1], args[2], args[3], args[4:])
    elif mode == "clean" and len(args) == 1:
        return clean()
    else:
        raise SystemExit(f"session_container.py: bad arguments {args!r}; see the docstring")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
