"""One run per workdir: an advisory lock held for the run's lifetime.

`flock` on `WORKDIR/.lock` (`.lock-<process>` for each process of a multi-process run, so the
processes of one run never contend), released by the kernel when the holder exits however it
exits: a run killed with SIGKILL leaves no stale lock, only its note of who held it, which the
next run reports as taken over. A second run on a busy workdir refuses at once, naming the
holder's host and pid.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxagent.errors import UserError


class WorkdirBusy(UserError):
    """Another run holds the workdir."""


@contextlib.contextmanager
def workdir_lock(workdir: str | Path, process: int = 0, processes: int = 1,
                 report: Callable[[str], None] = print) -> Iterator[None]:
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / (".lock" if processes == 1 else f".lock-{process}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            raise WorkdirBusy(f"{workdir}: in use by a run on {holder} (lock {path}); wait for "
                              "it to finish or choose another workdir") from None
        left = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if left:
            report(f"{workdir}: taking over from a run on {left} that ended without releasing it")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # a clean exit leaves nothing to take over
    finally:
        os.close(fd)  # releases the lock
