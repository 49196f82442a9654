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

import yaml

from jaxagent.config import ConfigError, load_config, to_yaml
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


# Keys that may differ when a run resumes: how long it runs and how it logs, evaluates and
# saves. Everything else (model, data, algorithm, optimizer) would silently make a different
# run of the checkpoint.
SAFE_ON_RESUME = ("train.steps", "train.log_rollouts", "train.profile_steps", "eval.",
                  "checkpoint.", "workdir", "distributed.")


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_resume_config(cfg, workdir: str | Path) -> None:
    """Before a run writes anything to a workdir that holds a checkpoint: its config must be
    the one the checkpoint was trained with, except SAFE_ON_RESUME keys, and those only with
    `checkpoint.allow_changes`. A ConfigError lists the differing keys in one line."""
    workdir = Path(workdir)
    saved = workdir / "config.yaml"
    if not saved.is_file() or not any(p.name.isdigit() for p in (workdir / "checkpoints").glob("*")):
        return
    old = _flat(yaml.safe_load(to_yaml(load_config(saved))))
    new = _flat(yaml.safe_load(to_yaml(cfg)))
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    unsafe = [k for k in changed if not k.startswith(SAFE_ON_RESUME)]
    safe = [k for k in changed if k.startswith(SAFE_ON_RESUME) and k != "checkpoint.allow_changes"]
    if unsafe:
        diffs = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in unsafe)
        raise ConfigError(f"{workdir}: resuming a run with a different config ({diffs}); use a new "
                          "workdir for a new run")
    if safe and not cfg.checkpoint.allow_changes:
        diffs = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in safe)
        raise ConfigError(f"{workdir}: resuming with changed settings ({diffs}); pass "
                          "checkpoint.allow_changes=true to resume with them")
