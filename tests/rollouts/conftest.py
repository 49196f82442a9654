"""Shared fixtures for sandbox tests: live sandboxes and a process-leak detector."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from rollouts.sandbox import Limits, Sandbox
from rollouts.tasks import Task, humaneval_tasks

HOSTILE_LIMITS = Limits(
    wall_s=2.0,
    cpu_s=2.0,
    memory_mb=256,
    max_procs=24,
    tmpfs_mb=32,
    output_bytes=256 << 10,
)


def _processes() -> dict[int, tuple[int, list[str]]]:
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        procs[int(name)] = (ppid, argv)
    return procs


def leftover_processes() -> list[str]:
    """Our descendants other than sandbox plumbing (sh/bwrap) and idle zygotes.

    A grader or solution is a fork of a zygote (same argv, zygote parent); anything
    a solution exec'd has another argv. Either one alive between runs is a leak.
    """
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo, leaks = list(children.get(os.getpid(), [])), []

    def is_zygote(argv: list[str]) -> bool:
        return os.path.basename(argv[0]) != "bwrap" and any(
            a.endswith("zygote.py") for a in argv
        )

    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        ppid, argv = procs[pid]
        plumbing = os.path.basename(argv[0]) in ("bwrap", "sh")
        parent_argv = procs.get(ppid, (0, [""]))[1]
        if not (plumbing or (is_zygote(argv) and not is_zygote(parent_argv))):
            leaks.append(f"{pid}: {' '.join(argv)[:120]}")
    return leaks


@pytest.fixture(scope="session")
def leftovers() -> Callable[[], list[str]]:
    return leftover_processes


@pytest.fixture(scope="session")
def humaneval() -> dict[str, Task]:
    return {t.id: t for t in humaneval_tasks()}


@pytest.fixture(scope="session")
def hostile_sandbox():
    with Sandbox("bwrap", workers=2, limits=HOSTILE_LIMITS) as sb:
        yield sb


@pytest.fixture(scope="session")
def bwrap_sandbox():
    with Sandbox("bwrap", workers=2) as sb:
        yield sb
