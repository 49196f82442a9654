"""Shared fixtures for sandbox tests: live sandboxes on both backends (docker on a private
engine this session starts), and process- and container-leak detectors."""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollouts.sandbox import Limits, Sandbox, SandboxUnavailable
from rollouts.sandbox.engine import private_engine
from rollouts.sandbox.image import host_image
from rollouts.sandbox.session import SessionContainer
from rollouts.tasks import Task, humaneval_tasks

BACKENDS = ("bwrap", "docker")

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
    """Our descendants other than sandbox plumbing (sh/bwrap), idle zygotes and idle session
    command servers.

    A grader, solution or command is a fork of a zygote or server (same argv, its parent);
    anything a solution exec'd has another argv. Either one alive between runs is a leak.
    """
    procs = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo, leaks = list(children.get(os.getpid(), [])), []

    def is_zygote(argv: list[str]) -> bool:
        return os.path.basename(argv[0]) != "bwrap" and any(
            a.endswith(("zygote.py", "command_server.py")) for a in argv
        )

    while todo:
        pid = todo.pop()
        ppid, argv = procs[pid]
        if os.path.basename(argv[0]) == "dockerd":  # our private engine: containers are
            continue  # checked by leftover_containers
        todo += children.get(pid, [])
        plumbing = os.path.basename(argv[0]) in ("bwrap", "sh")
        parent_argv = procs.get(ppid, (0, [""]))[1]
        if not (plumbing or (is_zygote(argv) and not is_zygote(parent_argv))):
            leaks.append(f"{pid}: {' '.join(argv)[:120]}")
    return leaks


_ENGINE: dict[str, str] = {}  # "image": the sandbox image, while this session's engine runs
_DOCKER_SANDBOXES: list[Sandbox] = []  # the session's live docker sandboxes
_DOCKER_SESSIONS: list[SessionContainer] = []  # the live agent sessions' containers


def leftover_containers() -> list[str]:
    """Containers of our engine that no live docker sandbox or session holds, and processes in
    those they hold beyond their idle zygote or init. [] where this session started no engine."""
    if not _ENGINE:
        return []
    channels = [w.channel for sb in _DOCKER_SANDBOXES for w in sb._workers]
    live = {c.container.id: c.container for c in channels if c is not None}
    if _DOCKER_SESSIONS:
        import docker  # the docker extra: there whenever an engine is

        containers = docker.from_env().containers
        live |= {c.id: c for c in (containers.get(s.name) for s in _DOCKER_SESSIONS)}
    ids = subprocess.run(["docker", "ps", "-aq", "--no-trunc"], capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    leaks = [f"container {c[:12]}" for c in ids if c not in live]
    for container in live.values():
        leaks += [f"{container.short_id}: {p[-1]}" for p in container.top()["Processes"][1:]]
    return leaks


@pytest.fixture(scope="session")
def docker_sessions() -> list[SessionContainer]:
    """Where a test lists the session containers it holds while `leftovers` looks."""
    return _DOCKER_SESSIONS


@pytest.fixture(scope="session")
def leftovers() -> Callable[[], list[str]]:
    """Processes of ours, containers, or processes in them that outlived a run."""
    return lambda: leftover_processes() + leftover_containers()


@pytest.fixture(scope="session")
def host_mounts() -> Callable[[], list[str]]:
    """Our mount table, less the mounts private docker engines make for their containers: this
    session's, and under xdist the other workers' (each starts its own, and their containers
    come and go in the host's mount table while this worker's test runs)."""
    engines = os.path.join(tempfile.gettempdir(), "jaxagent-dockerd-")

    def mounts() -> list[str]:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
        return [line for line in lines if engines not in line]

    return mounts


@pytest.fixture(scope="session")
def docker_image() -> Iterator[str]:
    """A private docker engine for the session (DOCKER_HOST points at it) holding the
    host-made sandbox image (cached across runs, see rollouts/sandbox/image.py); its tag.
    Skips, saying why, where the engine cannot start or run a container. At the end no
    container may remain."""
    saved = os.environ.get("DOCKER_HOST")
    with contextlib.ExitStack() as stack:
        try:
            os.environ["DOCKER_HOST"] = stack.enter_context(private_engine())
        except SandboxUnavailable as e:
            pytest.skip(f"no docker engine: {e}")
        stack.callback(_restore, "DOCKER_HOST", saved)
        stack.callback(_ENGINE.clear)
        _ENGINE["image"] = host_image()
        smoke = subprocess.run(["docker", "run", "--rm", "--network", "none", _ENGINE["image"],
                                "python3", "-S", "-c", "pass"], capture_output=True, text=True,
                               check=False)  # fmt: skip
        if smoke.returncode:  # e.g. a CI machine whose kernel refuses the container's set-up
            pytest.skip(f"the docker engine runs no container: {smoke.stderr.strip()[-300:]}")
        yield _ENGINE["image"]
        assert leftover_containers() == []


def _restore(name: str, saved: str | None) -> None:
    if saved is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = saved


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


def _docker_sandbox(image: str, **options) -> Iterator[Sandbox]:
    with Sandbox("docker", workers=2, image=image, **options) as sb:
        _DOCKER_SANDBOXES.append(sb)
        yield sb
        _DOCKER_SANDBOXES.remove(sb)


@pytest.fixture(scope="session")
def docker_hostile_sandbox(docker_image):
    yield from _docker_sandbox(docker_image, limits=HOSTILE_LIMITS)


@pytest.fixture(scope="session")
def docker_sandbox(docker_image):
    yield from _docker_sandbox(docker_image)


@pytest.fixture(params=BACKENDS)
def hostile_sandboxes(request) -> Sandbox:
    """hostile_sandbox's limits, on each backend."""
    return request.getfixturevalue(f"{'docker_' if request.param == 'docker' else ''}hostile_sandbox")


@pytest.fixture(params=BACKENDS)
def sandboxes(request) -> Sandbox:
    """Default limits, on each backend."""
    return request.getfixturevalue(f"{request.param}_sandbox")


@pytest.fixture(params=["bwrap", pytest.param("docker", marks=pytest.mark.slow)])
def sandboxes_docker_slow(request) -> Sandbox:
    """`sandboxes`, the docker half under -m slow: for suites too long to run twice by default."""
    return request.getfixturevalue(f"{request.param}_sandbox")
