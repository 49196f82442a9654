"""A persistent sandbox session: one repository work dir for a whole agent episode.

Files persist between tool calls; every command runs under the solution's rlimits and
confinement (guest/limited.py), with a wall timeout and an output cap, the work dir bound
read-write at /work, and nothing it started outlives it: bwrap runs each as a fork of the
session's command server (CommandServer: one sandbox per session with the read-only root,
namespaces, private /tmp and cgroup slot of a single run; each command's leftovers killed and
/tmp emptied after it; pytest imported once, so a test run is a fork); docker runs each as a
`docker exec` in one container per session (SessionContainer: no network, read-only root,
memory and pids caps, no capabilities; each command's leftovers killed and /tmp emptied after
it) or, with containers="command", as a `docker run --rm` of its own. The host reads and
writes files of the work dir directly, but only regular files whose real path stays inside it
(a command may leave symlinks or FIFOs behind). `renew` refills the work dir for a new episode
in the same sandbox; `close` kills what is left and removes the work dir.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
import weakref
from pathlib import Path, PurePosixPath
from typing import Self

from rollouts.sandbox.cgroups import Cgroup
from rollouts.sandbox.guest import wire
from rollouts.sandbox.guest.cleanup import wipe
from rollouts.sandbox.guest.confine import own
from rollouts.sandbox.guest.session_container import CLEANED
from rollouts.sandbox.launchers import (
    _CGROUP_OVERHEAD_MB,
    DOCKER_IMAGE,
    GUEST_DIR,
    SANDBOX_PYLIB,
    SESSION_WORKDIR,
    BwrapLauncher,
    PipeChannel,
    ProcessLauncher,
    SandboxUnavailable,
    base_python,
    in_cgroup,
    pytest_paths,
    sandbox_cgroup,
    solution_uid,
)
from rollouts.sandbox.run_cache import RunCache, workdir_digest
from rollouts.sandbox.types import Limits

_PYTHON_FLAGS = ("-S", "-B", "-E", "-s")
_TOOLS_DIR = "/tools"  # host binaries (ruff) bound read-only inside the sandbox
_CONTROL_DIR = "/session"  # a docker session container's token and lifeline (read-only)
CONTAINER_MODES = ("session", "command")
_PYTEST_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(\S.*)$")
# -rA: one outcome line per test; skips too, by node id, once not folded by reason
PYTEST_FLAGS = ("-q", "-rA", "--no-fold-skipped", "-p", "no:cacheprovider")
# pytest trims a short-summary reason to the terminal's width (80 columns without a terminal):
# a wide, fixed one keeps each reason whole (`AssertionError: MARGIN should be 41`, not
# `... MARGIN shou...` after a long test name), the same text on every host
_COLUMNS = "200"


def pytest_outcomes(output: str) -> dict[str, tuple[str, str]]:
    """node id -> (outcome, reason) from pytest's `-rA` short test summary. A parametrized id
    may hold spaces and " - " inside its brackets (`test_p[c - d]`): the id ends at the first
    " - " outside them."""
    outcomes = {}
    for line in output.splitlines():
        m = _PYTEST_LINE.match(line.strip())
        if m is not None:
            kind, rest = m.groups()
            test, why = _split_reason(rest)
            outcomes[test] = (kind.lower(), why)
    return outcomes


def _split_reason(rest: str) -> tuple[str, str]:
    depth = 0
    for i, c in enumerate(rest):
        depth += (c == "[") - (c == "]")
        if depth == 0 and rest.startswith(" - ", i):
            return rest[:i], rest[i + 3:]
    return rest.rstrip(), ""


def _check_docker_engine() -> None:
    """SandboxUnavailable, saying why, unless a docker CLI reaches an engine."""
    if shutil.which("docker") is None:
        raise SandboxUnavailable("docker sessions: no `docker` CLI on PATH")
    try:
        probe = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                               capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        raise SandboxUnavailable("docker sessions: the engine did not answer in 30 s") from None
    if probe.returncode:
        why = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise SandboxUnavailable(f"docker sessions: engine not reachable: {why}")


def container_options(*, workdir: str, limits: Limits, tools: dict[str, str], uid: int) -> list[str]:
    """`docker run` options of a session's container: the work dir read-write at /work (its
    commands run as `uid`, which owns it), the harness, pytest and tools read-only, no
    network, a read-only root with a private /tmp, the memory and process caps of a single
    run, no capabilities."""
    mem = f"{limits.memory_mb + limits.tmpfs_mb + _CGROUP_OVERHEAD_MB}m"
    mounts = {workdir: f"{SESSION_WORKDIR}:rw", str(GUEST_DIR): "/harness:ro",
              **{path: f"{SANDBOX_PYLIB}/{lib}:ro" for lib, path in pytest_paths().items()},
              **{path: f"{_TOOLS_DIR}/{tool}:ro" for tool, path in tools.items()}}
    env = {"PATH": f"{_TOOLS_DIR}:/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": SANDBOX_PYLIB,
           "PYTHONDONTWRITEBYTECODE": "1", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/tmp",
           "LANG": "C.UTF-8", "COLUMNS": _COLUMNS}
    return [
        "--network", "none", "--read-only", "--tmpfs", f"/tmp:size={limits.tmpfs_mb}m,mode=1777",
        "--memory", mem, "--memory-swap", mem, "--pids-limit", str(limits.max_procs + 8),
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--user", f"{uid}:{uid}", "--workdir", SESSION_WORKDIR,
        *(a for host, inside in mounts.items() for a in ("--volume", f"{host}:{inside}")),
        *(a for k, v in env.items() for a in ("--env", f"{k}={v}")),
    ]


def _limits_json(limits: Limits, uid: int | None) -> str:
    return json.dumps({**dataclasses.asdict(limits), "solution_uid": uid})


def docker_argv(command: list[str], *, name: str, image: str, workdir: str, limits: Limits,
                tools: dict[str, str], uid: int) -> list[str]:
    """`docker run` of one session command in a container `name` of its own, under
    guest/limited.py as under bwrap."""
    return ["docker", "run", "--rm", "--name", name,
            *container_options(workdir=workdir, limits=limits, tools=tools, uid=uid),
            image, "python3", *_PYTHON_FLAGS, "/harness/limited.py",
            _limits_json(limits, uid), *command]  # fmt: skip


class SessionContainer:
    """One container for a whole docker session (guest/session_container.py): started once
    with the options of a per-command container; each command a `docker exec` of a wrapper
    that runs it under guest/limited.py, then kills whatever it left and empties /tmp (the
    host does that in a `docker exec` of its own when the wrapper cannot report it did).
    The host holds the write end of a FIFO whose read end is the container's pid 1: when
    this process dies, the container ends and `--rm` removes it. A child forked from the host
    (`os.fork`, multiprocessing's fork) keeps neither: it closes its copy of the lifeline, so
    the container still goes with the host, and its exit removes nothing."""

    def __init__(self, *, image: str, workdir: str, limits: Limits, tools: dict[str, str],
                 uid: int, control: Path):
        self.image, self.limits, self.uid = image, limits, uid
        self.options = container_options(workdir=workdir, limits=limits, tools=tools, uid=uid)
        control.mkdir(mode=0o755)  # read-only at /session; the uid reads the token there
        self.token_file = control / "token"
        self.token_file.write_text("")
        self.token_file.chmod(0o644)
        os.mkfifo(control / "lifeline", 0o644)
        self.control = control
        # read-write: the open needs no reader, and counts as the writer pid 1 waits on
        self.lifeline = os.open(control / "lifeline", os.O_RDWR)
        self.name = f"jaxagent-session-{uuid.uuid4().hex[:12]}"
        # at close, when the session is dropped unclosed, or at exit: nothing keeps it
        self._finalizer = weakref.finalize(self, _remove_container, self.name, self.lifeline)
        _OPEN.add(self)
        _watch_forks()
        self.start()

    def start(self) -> None:
        self._new_token()
        argv = ["docker", "run", "--detach", "--rm", "--name", self.name, *self.options,
                "--volume", f"{self.control}:{_CONTROL_DIR}:ro", self.image,
                "python3", *_PYTHON_FLAGS, "/harness/session_container.py", "init",
                f"{_CONTROL_DIR}/lifeline"]  # fmt: skip
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        if run.returncode:
            raise SandboxUnavailable(f"docker sessions: the session's container did not start: "
                                     f"{run.stderr.strip()[-300:]}")

    def _new_token(self) -> None:
        self.token = uuid.uuid4().hex
        self.token_file.write_text(self.token)

    def exec_argv(self, command: list[str]) -> list[str]:
        # pid 1 and the command's wrapper run as its uid too: RLIMIT_NPROC leaves the command
        # as many processes as one alone in its container gets
        limits = dataclasses.replace(self.limits, max_procs=self.limits.max_procs + 2)
        return ["docker", "exec", self.name, "python3", *_PYTHON_FLAGS,
                "/harness/session_container.py", "run", f"{_CONTROL_DIR}/token", self.token,
                _limits_json(limits, self.uid), *command]  # fmt: skip

    def finish(self, stderr: bytes) -> bytes:
        """After a command's `docker exec` ended or was killed: unless its stderr ends with
        the report that it cleaned up after itself, clean up here. What stderr held besides
        the report (the engine's or the wrapper's errors)."""
        if stderr.endswith(CLEANED):
            return stderr[: -len(CLEANED)]
        self.clean()
        return stderr

    def clean(self) -> None:
        """Revoke the command's token, kill what it left, empty /tmp; a container whose
        cleanup fails (or that died) is replaced: the work dir is the host's and stays."""
        self._new_token()
        argv = ["docker", "exec", self.name, "python3", *_PYTHON_FLAGS,
                "/harness/session_container.py", "clean"]
        try:
            ok = subprocess.run(argv, capture_output=True, timeout=60, check=False).returncode == 0
        except subprocess.TimeoutExpired:
            ok = False
        if not ok:
            _docker_rm(self.name)
            self.start()

    def close(self) -> None:
        self._finalizer()


_OPEN: weakref.WeakSet[SessionContainer] = weakref.WeakSet()


@functools.cache
def _watch_forks() -> None:
    os.register_at_fork(after_in_child=_forget_in_child)


def _forget_in_child() -> None:
    """In a forked child: the parent's open session containers are not the child's (see
    SessionContainer)."""
    for container in list(_OPEN):
        if container._finalizer.detach() is not None:  # still open in the parent
            os.close(container.lifeline)
    _OPEN.clear()


def _docker_rm(name: str) -> None:
    subprocess.run(["docker", "rm", "--force", name], capture_output=True, timeout=60,
                   check=False)


def _remove_container(name: str, lifeline: int) -> None:
    _docker_rm(name)
    os.close(lifeline)


class CommandServer:
    """A bwrap session's one sandbox (guest/command_server.py): each command a fork of a server
    that imported pytest once, so a test run costs its collection and tests, not a sandbox's and
    an interpreter's start and pytest's import (0.22 -> 0.08 s on a 2-core VM, docs/agent.md).
    Started with the session, so its start overlaps what the host does before the first command;
    started afresh after a command that left it unclean, killed it, or outlived its grace."""

    _START_S = 30.0  # bwrap and an interpreter importing pytest, on a loaded machine
    _GRACE_S = 5.0  # beyond a command's timeout, for the server's cleanup and reply

    def __init__(self, argv: list[str], limits: dict, cgroup: Cgroup | None):
        self.argv, self.limits, self.cgroup = argv, limits, cgroup
        self.channel: PipeChannel | None = None
        self.ready = False
        self._start()

    def _start(self) -> None:
        self.channel = PipeChannel(self.argv, stderr=subprocess.DEVNULL)
        self.channel.send({"limits": self.limits, "pylib": [SANDBOX_PYLIB]})
        self.ready = False

    def run(self, argv: list[str], *, pytest: bool, timeout_s: float,
            output_bytes: int) -> dict | None:
        """The server's reply (see guest/command_server.py), or None when it died or stuck.
        A server found dead before the command reached it is replaced once."""
        request = {"argv": argv, "pytest": pytest, "timeout_s": timeout_s,
                   "output_bytes": output_bytes}
        for _ in range(2):
            try:
                self._ready()
                self.channel.send(request)
                break
            except (TimeoutError, OSError, wire.FrameError):  # nothing of the command ran
                self.stop()
        else:
            return None
        try:
            reply = self.channel.recv(timeout_s + self._GRACE_S)
        except (TimeoutError, OSError, wire.FrameError):
            reply = None
        if reply is None or not reply["clean"]:
            self.stop()
        return reply

    def _ready(self) -> None:
        if self.channel is not None and not self.channel.alive():  # died between commands
            self.stop()
        if self.channel is None:
            self._start()
        if not self.ready:
            hello = self.channel.recv(self._START_S)
            if not (isinstance(hello, dict) and hello.get("ready")):
                raise BrokenPipeError(f"the session's command server did not start ({hello!r})")
            self.ready = True

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.cgroup:
            self.cgroup.kill_all()


def _wait(proc: subprocess.Popen, timeout: float) -> int | None:
    """`proc`'s exit code, or None after `timeout` s: woken by the exit itself (a pidfd), where
    Popen.wait(timeout) polls and oversleeps by up to 50 ms."""
    exited = os.pidfd_open(proc.pid)
    try:
        if not select.select([exited], [], [], timeout)[0]:
            return None
    finally:
        os.close(exited)
    return proc.wait()


class SessionError(ValueError):
    """A path or request the session refuses (outside the work dir, not a file, ...)."""


@dataclasses.dataclass(frozen=True)
class ExecResult:
    exit_code: int | None  # None when the command was killed at its timeout
    output: str  # stdout and stderr interleaved, at most limits.output_bytes
    output_bytes: int  # bytes the command wrote (more than `output` when capped)
    timed_out: bool
    seconds: float
    over_quota: bool  # the work dir outgrew limits.tmpfs_mb
    cached: bool = False  # read from a `RunCache`: an earlier run on the same files


class Session:
    """One episode's repository in a sandbox.

        with Session(task.files, backend="bwrap") as s:
            s.exec("python -m pytest -q")
            s.write_text("pkg/mod.py", "...")
    """

    def __init__(
        self,
        files: dict[str, str | bytes],
        backend: str = "bwrap",
        limits: Limits | None = None,
        tools: dict[str, str] | None = None,
        git_source: str | None = None,
        image: str | None = None,
        containers: str = "session",
    ):
        """`containers` (docker): "session", one container for the session, each command a
        `docker exec` in it (SessionContainer); "command", a `docker run` per command."""
        if backend not in ("bwrap", "docker", "process"):
            raise SandboxUnavailable(
                f"sandbox sessions support the bwrap, docker and process backends, not "
                f"{backend!r}"
            )
        if containers not in CONTAINER_MODES:
            raise ValueError(f"containers must be one of {CONTAINER_MODES}, not {containers!r}")
        self.limits = limits or Limits()
        self.backend = backend
        self.image = image or DOCKER_IMAGE
        if backend == "docker":
            _check_docker_engine()
        self.launcher = None  # docker: SessionContainer, or a `docker run` per command
        if backend == "bwrap":
            self.launcher = BwrapLauncher(self.limits, use_cgroups=False)
        elif backend == "process":
            self.launcher = ProcessLauncher(self.limits)  # warns: no isolation
        self._container: str | None = None  # the docker command's own container, running now
        # commands run as this uid (confined, guest/confine.py); None: unconfined (process)
        self.uid = solution_uid() if backend != "process" else None
        self.tools = dict(tools or {})
        self._tmp = Path(tempfile.mkdtemp(prefix="jaxagent-session-"))
        self.root = self._tmp / "work"
        self.cgroup = sandbox_cgroup(self.limits) if backend == "bwrap" else None
        self.root.mkdir()
        self._fill(files, git_source)
        self.container = None
        self.server = self._command_server() if backend == "bwrap" else None
        if backend == "docker" and containers == "session":
            try:
                self.container = SessionContainer(
                    image=self.image, workdir=str(self.root), limits=self.limits,
                    tools=self.tools, uid=self.uid, control=self._tmp / "control")  # fmt: skip
            except BaseException:
                shutil.rmtree(self._tmp, ignore_errors=True)
                raise

    def _fill(self, files: dict[str, str | bytes], git_source: str | None) -> None:
        if git_source is not None:  # a bundle or repository of ours, cloned before any untrusted code ran
            subprocess.run(
                ["git", "clone", "-q", str(git_source), str(self.root)],
                check=True,
                capture_output=True,
            )
        for rel, content in files.items():
            self.write_text(rel, content)

    def renew(self, files: dict[str, str | bytes], git_source: str | None = None) -> None:
        """The work dir holding `files` (and `git_source`'s history) alone, for a new episode
        in the same sandbox: the bwrap command server or docker session container is kept, as
        between two commands (nothing a command started outlives it, /tmp is emptied after
        it), and so is the uid. Saves a sandbox's start and pytest's import an episode."""
        if not wipe(str(self.root)):  # emptied, not removed: the sandbox binds this directory
            raise SessionError(f"could not empty the work dir {self.root} for a new episode")
        self._fill(files, git_source)

    # ---- files (host side) ----
    def path(self, rel: str) -> Path:
        """The host path of `rel`; SessionError if it leaves the work dir."""
        p = PurePosixPath(rel)
        if not rel or p.is_absolute() or ".." in p.parts:
            raise SessionError(
                f"path {rel!r} must be relative to the repository root, without '..'"
            )
        full = self.root / p
        real = Path(os.path.realpath(full))
        if real != self.root and self.root not in real.parents:
            raise SessionError(f"path {rel!r} resolves outside the repository")
        return full

    def read_text(self, rel: str) -> str:
        full = self.path(rel)
        if not full.exists():
            raise SessionError(f"file {rel!r} does not exist")
        if not full.is_file():  # directories, FIFOs, devices
            raise SessionError(f"{rel!r} is not a regular file")
        data = full.read_bytes()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:  # never shown as text: its bytes would be noise or a leak
            raise SessionError(f"{rel!r} is a binary file, {len(data)} bytes") from None

    def write_text(self, rel: str, content: str | bytes) -> None:
        """Write `content` (bytes: a binary file, byte for byte) as a regular file."""
        full = self.path(rel)
        if full.is_dir():
            raise SessionError(f"{rel!r} is a directory")
        full.parent.mkdir(parents=True, exist_ok=True)
        self.path(rel)  # the parents may be symlinks made by a command: check again
        if full.is_symlink():
            full.unlink()  # write a regular file, never through a link
        if isinstance(content, bytes):
            full.write_bytes(content)
        else:
            full.write_text(content, encoding="utf-8")

    def files(self) -> dict[str, str]:
        """Every regular UTF-8 file of the work dir outside .git (symlinks and binary files,
        bytecode caches included, are skipped: a solution is text)."""
        out = {}
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if d != ".git")
            for name in sorted(filenames):
                full = Path(dirpath) / name
                if full.is_symlink() or not full.is_file():
                    continue
                try:
                    out[str(full.relative_to(self.root))] = full.read_text("utf-8")
                except UnicodeDecodeError:
                    continue
        return out

    def disk_bytes(self) -> int:
        return sum(
            os.lstat(os.path.join(d, f)).st_size
            for d, _, fs in os.walk(self.root)
            for f in fs
        )

    # ---- commands (sandboxed) ----
    def _command_server(self) -> CommandServer:
        binds = {path: f"{_TOOLS_DIR}/{name}" for name, path in self.tools.items()}
        py = base_python()
        env = {
            "PATH": f"{_TOOLS_DIR}:{os.path.dirname(py)}:/usr/bin:/bin",
            "PYTHONPATH": SANDBOX_PYLIB,
            "PYTHONDONTWRITEBYTECODE": "1",
            "GIT_CONFIG_NOSYSTEM": "1",
            "COLUMNS": _COLUMNS,
        }
        server = [py, *_PYTHON_FLAGS, "/harness/command_server.py"]
        argv = self.launcher.wrap(server, binds=binds, workdir=str(self.root), env=env)
        argv = in_cgroup(argv, self.cgroup) if self.cgroup else argv
        return CommandServer(argv, json.loads(_limits_json(self.limits, self.uid)), self.cgroup)

    def _own(self) -> None:
        if self.uid is not None and self.uid != os.geteuid():  # root: files the host wrote
            own(str(self.root), self.uid)

    def _argv(self, command: list[str]) -> tuple[list[str], dict | None, str | None]:
        """docker's and the process backend's argv of one command (bwrap: `self.server`)."""
        if self.container is not None:
            return self.container.exec_argv(command), None, None
        if self.backend == "docker":
            self._container = f"jaxagent-session-{uuid.uuid4().hex[:12]}"
            argv = docker_argv(command, name=self._container, image=self.image,
                               workdir=str(self.root), limits=self.limits, tools=self.tools,
                               uid=self.uid)
            return argv, None, None
        tool_dirs = [os.path.dirname(p) for p in self.tools.values()]
        pylib = sorted({os.path.dirname(p) for p in pytest_paths().values()})
        env = {
            "PATH": ":".join([*tool_dirs, os.path.dirname(base_python()), "/usr/bin:/bin"]),
            "PYTHONPATH": ":".join(pylib),
            "PYTHONDONTWRITEBYTECODE": "1",
            "HOME": str(self._tmp),
            "LANG": "C.UTF-8",
            "COLUMNS": _COLUMNS,
        }
        limited = str(GUEST_DIR / "limited.py")
        limits = _limits_json(self.limits, self.uid)
        return [base_python(), *_PYTHON_FLAGS, limited, limits, *command], env, str(self.root)

    def exec(self, command: str | list[str], timeout_s: float | None = None) -> ExecResult:
        """Run `command` (a shell string, or an argv) in the work dir, sandboxed."""
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        return self._exec(argv, timeout_s, pytest=False)

    def run_pytest(
        self, args: list[str], timeout_s: float | None = None, cache: RunCache | None = None
    ) -> tuple[ExecResult, dict[str, tuple[str, str]]]:
        """`python -m pytest ARGS` in the work dir, with each test's outcome (bwrap: run in a
        fork of the session's command server, which imported pytest already). With `cache`, an
        earlier clean run on the same files and settings is read instead (see `RunCache`)."""
        args = [*args, *PYTEST_FLAGS]
        if cache is None:
            return self._pytest(args, timeout_s)
        before = workdir_digest(self.root)
        key = RunCache.key(before, self.backend, self.image, self.limits, self.tools, args,
                           timeout_s)

        def run():  # kept if it ended by itself and left the work dir as it found it
            result, outcomes = self._pytest(args, timeout_s)
            return result, outcomes, (result.exit_code is not None and not result.timed_out
                                      and not result.over_quota
                                      and workdir_digest(self.root) == before)

        return cache.run(key, run)

    def _pytest(self, args: list[str], timeout_s: float | None):
        if self.server is not None:
            result = self._exec(args, timeout_s, pytest=True)
        else:
            result = self._exec(["python", "-m", "pytest", *args], timeout_s, pytest=False)
        return result, pytest_outcomes(result.output)

    def _exec(self, argv: list[str], timeout_s: float | None, pytest: bool) -> ExecResult:
        timeout = min(timeout_s or self.limits.wall_s, self.limits.wall_s)
        self._own()
        start = time.monotonic()
        if self.server is not None:
            code, timed_out, data, size = self._serve(argv, pytest, timeout)
        else:
            code, timed_out, data, size = self._run(argv, timeout)
        return ExecResult(
            exit_code=code,
            output=data.decode("utf-8", "replace"),
            output_bytes=size,
            timed_out=timed_out,
            seconds=time.monotonic() - start,
            over_quota=self.disk_bytes() > self.limits.tmpfs_mb << 20,
        )

    def _serve(self, argv: list[str], pytest: bool, timeout: float) -> tuple[int | None, bool, bytes, int]:  # fmt: skip
        start = time.monotonic()
        reply = self.server.run(argv, pytest=pytest, timeout_s=timeout,
                                output_bytes=self.limits.output_bytes)
        if reply is None:  # the command took the server down (or stuck it): a fresh one next
            why = b"sandbox: the session's command server stopped answering; restarted\n"
            return None, time.monotonic() - start >= timeout, why, len(why)
        data = reply["output"].encode("latin-1")
        return reply["exit_code"], reply["timed_out"], data, reply["output_bytes"]

    def _run(self, argv: list[str], timeout: float) -> tuple[int | None, bool, bytes, int]:
        """A process of its own per command: docker's, the process backend's."""
        full, env, cwd = self._argv(argv)
        # a session container's exec reports on stderr (SessionContainer.finish)
        with tempfile.TemporaryFile(dir=self._tmp) as out, tempfile.TemporaryFile(dir=self._tmp) as err:  # fmt: skip
            proc = subprocess.Popen(
                full, stdin=subprocess.DEVNULL, stdout=out, env=env, cwd=cwd,
                stderr=err if self.container is not None else subprocess.STDOUT,
                start_new_session=True,
            )
            code = _wait(proc, timeout)
            self._kill(proc)
            if self.container is not None:
                err.seek(0)
                out.write(self.container.finish(err.read()))
            size = out.seek(0, os.SEEK_END)
            out.seek(0)
            data = out.read(self.limits.output_bytes)
        return code, code is None, data, size

    def _kill(self, proc: subprocess.Popen) -> None:
        """Nothing a command starts outlives it (a docker container is removed, or cleaned,
        which a killed `docker` client would not do)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        if self._container is not None:
            _docker_rm(self._container)
            self._container = None

    @property
    def workdir_inside(self) -> str:
        """The work dir as commands see it."""
        return str(self.root) if self.backend == "process" else SESSION_WORKDIR

    def close(self) -> None:
        if self.container is not None:
            self.container.close()
        if self.server is not None:
            self.server.stop()
        if self.cgroup:
            self.cgroup.kill_all()
            self.cgroup.remove()
            self.cgroup = None
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
