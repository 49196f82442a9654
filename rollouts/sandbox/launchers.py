"""Start a zygote inside a sandbox and talk to it: bwrap, docker, or a bare process.

Each launcher returns a `Channel`; the pool (`pool.Sandbox`) drives it. A channel
is one sandbox holding one zygote, running one solution at a time.
"""

from __future__ import annotations

import errno
import glob
import importlib.util
import itertools
import os
import select
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path
from typing import Protocol

from rollouts.sandbox.cgroups import Cgroup, oom_counter, oom_kill_count
from rollouts.sandbox.guest import wire
from rollouts.sandbox.types import Limits

GUEST_DIR = Path(__file__).resolve().parent / "guest"
# Imported once by the zygote, so solutions get them for free. Small on purpose:
# every preloaded page makes each per-run fork dearer (measured: the larger set
# with decimal/hashlib/json/random/statistics was ~10% slower on HumanEval).
PRELOAD = ("bisect", "collections", "copy", "functools", "heapq", "itertools", "math", "operator", "re", "string", "typing")  # fmt: skip
# No site-packages, no .pyc writes, no PYTHON* environment variables.
_PYTHON_FLAGS = ("-S", "-B", "-E", "-s")
_CGROUP_OVERHEAD_MB = 96  # zygote + grader + bwrap, on top of the solution's budget
_PYTEST_PACKAGES = (
    "pytest",
    "_pytest",
    "pluggy",
    "iniconfig",
    "packaging",
    "pygments",
    "py",
)
SANDBOX_PYLIB = "/pylib"  # where repository tasks find pytest inside bwrap/docker
SESSION_WORKDIR = "/work"  # a session's persistent repository inside bwrap
DOCKER_IMAGE = "python:3.11-slim"  # the docker backend's default; a task's metadata["docker_image"] overrides it
# The docker zygote is the container's root with only what it needs to hand each solution a
# uid of its own (guest/confine.py) and to kill and wipe what that uid left; solutions keep none.
_ZYGOTE_CAPS = ("SETUID", "SETGID", "SETPCAP", "CHOWN", "FOWNER", "DAC_OVERRIDE", "KILL")


class SandboxUnavailable(RuntimeError):
    """The backend cannot run here (no bwrap binary, no docker engine, ...)."""


class Channel(Protocol):
    def send(self, obj: object) -> None: ...
    def recv(self, timeout: float) -> object | None: ...  # None on EOF; TimeoutError
    def oom_kills(self) -> int: ...
    def leftover(self) -> bool: ...  # processes beyond the idle zygote remain
    def alive(self) -> bool: ...
    def close(self, graceful: bool = False) -> None: ...


class Launcher(Protocol):
    name: str

    def launch(self, image: str | None) -> Channel: ...

    # argv running a one-shot host tool (the linter) with the backend's isolation
    def tool_argv(self, binary: str, args: list[str]) -> list[str]: ...


def base_python() -> str:
    """The real interpreter behind this (possibly venv) Python, run without site."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def pytest_paths() -> dict[str, str]:
    """name -> host path of pytest and its dependencies, for repository tasks ({} if absent)."""
    if importlib.util.find_spec("pytest") is None:
        return {}
    paths = {}
    for name in _PYTEST_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            path = (
                os.path.dirname(spec.origin)
                if spec.submodule_search_locations
                else spec.origin
            )
            paths[os.path.basename(path)] = path
    return paths


def hello(
    channel: Channel,
    workroot: str,
    pylib: list[str],
    isolated: bool,
    timeout: float = 30.0,
    uid: int | None = None,
) -> dict:
    """Start the zygote. `isolated`: it has namespaces of its own, so clearing SysV
    IPC objects and keyrings after each run touches nothing outside the sandbox, and
    solutions are confined (guest/confine.py), as `uid` where the sandbox runs as root."""
    channel.send(
        {
            "workroot": workroot,
            "preload": list(PRELOAD),
            "pylib": pylib,
            "isolated": isolated,
            "solution_uid": (solution_uid() if uid is None else uid) if isolated else None,
        }
    )
    reply = channel.recv(timeout)
    if not isinstance(reply, dict) or not reply.get("ready"):
        channel.close()
        raise SandboxUnavailable(
            f"zygote failed to start (reply {reply!r}); see stderr above"
        )
    return reply


class FdChannel:
    """Frames to a zygote on one fd, its replies on another."""

    to_zygote: int
    from_zygote: int

    def send(self, obj: object) -> None:
        wire.send(self.to_zygote, obj)

    def recv(self, timeout: float) -> object | None:
        if not select.select([self.from_zygote], [], [], timeout)[0]:
            raise TimeoutError(f"no reply from the sandbox within {timeout:.1f}s")
        return wire.recv(self.from_zygote)


class PipeChannel(FdChannel):
    """A zygote subprocess on stdin/stdout pipes, optionally inside a cgroup."""

    def __init__(
        self,
        argv: list[str],
        cgroup: Cgroup | None = None,
        cleanup_dir: str | None = None,
        **popen,
    ):
        self.cgroup, self.cleanup_dir = cgroup, cleanup_dir
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, **popen
        )
        self.to_zygote, self.from_zygote = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        self.baseline = 0

    def oom_kills(self) -> int:
        return self.cgroup.oom_kills() if self.cgroup else 0

    def leftover(self) -> bool:
        return bool(self.cgroup) and len(self.cgroup.pids()) > self.baseline

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, graceful: bool = False) -> None:
        """Graceful: EOF lets the zygote (then bwrap) exit by itself; else SIGKILL."""
        if graceful:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            stream.close()
        if self.cgroup:  # bwrap --die-with-parent takes the rest down; make sure
            self.cgroup.kill_all()
            self.cgroup.remove()
        if self.cleanup_dir:
            shutil.rmtree(self.cleanup_dir, ignore_errors=True)


def _site_dirs(prefix: str) -> list[str]:
    """Installed-package dirs under the bound roots (they may hold datasets with answers)."""
    paths = sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})
    debian = glob.glob("/usr/lib/python3*/dist-packages")
    debian += glob.glob("/usr/local/lib/python3*/dist-packages")
    candidates = {paths["purelib"], paths["platlib"], *debian}
    return sorted(p for p in candidates if os.path.isdir(p))


def _parents(inside: str) -> list[str]:
    """Create the directories above a bind target as 0755: bwrap makes them 0700 (or copies
    the host's /root), and the solution's uid must be able to walk down to what is bound."""
    args = []
    for parent in reversed(Path(inside).parents[:-1]):
        args += ["--perms", "0755", "--dir", str(parent)]
    return args


def _root_args(prefix: str) -> list[str]:
    """A read-only root holding only what the interpreter needs: /usr, /lib*, its prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    if prefix != "/usr" and not prefix.startswith("/usr/"):
        args += [*_parents(prefix), "--ro-bind", prefix, prefix]
    for site in _site_dirs(prefix):
        args += ["--tmpfs", site]  # mask installed packages
    return args


def _bind_args(binds: dict[str, str]) -> list[str]:
    """Extra read-only binds, pytest for repository tasks, and the harness itself."""
    binds = {**binds, **{path: f"{SANDBOX_PYLIB}/{name}" for name, path in pytest_paths().items()}}
    args = []
    for host, inside in {**binds, str(GUEST_DIR): "/harness"}.items():
        args += [*_parents(inside), "--ro-bind", host, inside]
    return args


_COMMON = ["--die-with-parent", "--new-session", "--clearenv"]
# Every namespace but the user one as root: a user namespace would map uid 0 alone, and the
# solution must become another uid (guest/confine.py). As a normal user, bwrap's user
# namespace is the only way in.
_ROOT_NAMESPACES = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]  # fmt: skip
_SOLUTION_UIDS = itertools.count(1_000_000)  # far above any account on the host


def solution_uid() -> int:
    """A fresh uid for one sandbox's solutions where the host runs as root (no two sandboxes
    share an RLIMIT_NPROC count or own each other's files); elsewhere our own uid."""
    return next(_SOLUTION_UIDS) if os.geteuid() == 0 else os.geteuid()


def _isolation(privileged: bool) -> list[str]:
    """bwrap's namespace and capability options. `privileged`: the command drops its
    privileges itself (the zygote, limited.py) and needs them to do so; else none at all."""
    namespaces = _ROOT_NAMESPACES if os.geteuid() == 0 else ["--unshare-all"]
    caps = ["--cap-add", "ALL"] if privileged and os.geteuid() else []
    return [*namespaces, *_COMMON, *(caps if privileged else ["--cap-drop", "ALL"])]

_ENV = ["--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]  # fmt: skip
# /tmp (size-capped) is the only writable place; then /dev and / go read-only.
_FINISH = ["--dev", "/dev", "--proc", "/proc", "--remount-ro", "/dev"]
_FINISH += ["--remount-ro", "/"]


def in_cgroup(argv: list[str], cgroup: Cgroup) -> list[str]:
    """Join the cgroups in a shell that then execs `argv`, so every sandbox process is
    born inside them (preexec_fn is unsafe in our threaded host)."""
    join = 'for f in "$@"; do case $f in --) shift; break;; esac; echo $$ > "$f"; shift; done; exec "$@"'
    return ["/bin/sh", "-c", join, "sh", *cgroup.procs_files, "--", *argv]


def sandbox_cgroup(limits: Limits) -> Cgroup | None:
    """A cgroup slot sized like a zygote's (None where cgroup v1 is not writable)."""
    mem = (limits.memory_mb + limits.tmpfs_mb + _CGROUP_OVERHEAD_MB) << 20
    return Cgroup.create(limits.max_procs + 8, mem)


class BwrapLauncher:
    """bubblewrap: read-only minimal root, private tmpfs, all namespaces unshared."""

    name = "bwrap"

    def __init__(self, limits: Limits, use_cgroups: bool = True):
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailable(
                "bwrap not found: install it with `apt-get install -y bubblewrap`"
            )
        self.limits, self.use_cgroups = limits, use_cgroups
        self.python = base_python()

    def tool_argv(self, binary: str, args: list[str]) -> list[str]:
        """argv running a host tool (the linter) in a one-shot sandbox like the zygote's."""
        inside = f"/tools/{os.path.basename(binary)}"
        return self.wrap([inside, *args], binds={binary: inside}, privileged=False)

    def wrap(
        self,
        command: list[str],
        binds: dict[str, str] | None = None,
        workdir: str | None = None,
        env: dict[str, str] | None = None,
        privileged: bool = True,
    ) -> list[str]:
        """bwrap argv running `command` sandboxed; `binds` maps host paths in read-only;
        `workdir` (sessions) is a host directory bound read-write at /work, the cwd;
        `privileged` (see `_isolation`): `command` confines itself before any untrusted code."""
        tmpfs = ["--size", str(self.limits.tmpfs_mb << 20), "--perms", "1777", "--tmpfs", "/tmp"]
        root = _root_args(os.path.realpath(sys.base_prefix))
        extra = _bind_args(binds or {})
        work = ["--bind", workdir, SESSION_WORKDIR] if workdir else []
        chdir = ["--chdir", SESSION_WORKDIR if workdir else "/tmp"]
        setenv = [a for k, v in (env or {}).items() for a in ("--setenv", k, v)]
        return [
            self.bwrap,
            *_isolation(privileged),
            *_ENV,
            *setenv,
            *root,
            *extra,
            *tmpfs,
            *work,
            *_FINISH,
            *chdir,
            *command,
        ]

    def launch(self, image: str | None) -> Channel:
        del image  # one host root for every task
        cgroup = sandbox_cgroup(self.limits) if self.use_cgroups else None
        argv = self.wrap([self.python, *_PYTHON_FLAGS, "/harness/zygote.py"])
        if cgroup:
            argv = in_cgroup(argv, cgroup)
        channel = PipeChannel(argv, cgroup=cgroup)
        hello(channel, "/tmp", [SANDBOX_PYLIB], isolated=True)
        channel.baseline = len(cgroup.pids()) if cgroup else 0
        return channel


class ProcessLauncher:
    """No isolation at all: only for trusted code (opt-in, warns)."""

    name = "process"

    def __init__(self, limits: Limits):
        warnings.warn(
            "sandbox backend 'process' runs solutions WITHOUT isolation; use it only for trusted code",
            stacklevel=4,  # point at the Sandbox(...) call
        )
        self.limits = limits

    def tool_argv(self, binary: str, args: list[str]) -> list[str]:
        return [binary, *args]

    def launch(self, image: str | None) -> Channel:
        del image
        workroot = tempfile.mkdtemp(prefix="jaxagent-run-")
        argv = [base_python(), *_PYTHON_FLAGS, str(GUEST_DIR / "zygote.py")]
        env = {"PATH": "/usr/bin:/bin", "HOME": workroot, "LANG": "C.UTF-8"}
        channel = PipeChannel(argv, cleanup_dir=workroot, cwd=workroot, env=env)
        pylib = sorted({os.path.dirname(p) for p in pytest_paths().values()})
        # Not isolated: the host's IPC objects and keyrings are not ours to clear.
        hello(channel, workroot, pylib, isolated=False)
        return channel


class DockerChannel(FdChannel):
    """A zygote in a container, over two FIFOs of a host folder bound into it at /channel:
    direct, where the engine's attach stream would pass every frame through dockerd."""

    def __init__(self):
        self.fifos = tempfile.mkdtemp(prefix="jaxagent-docker-")  # 0700: the solution's uid
        for name in ("in", "out"):  # cannot reach them
            os.mkfifo(os.path.join(self.fifos, name), 0o600)
        # A reader first: the container's shell then opens "out" at once, before "in".
        self.from_zygote = os.open(os.path.join(self.fifos, "out"), os.O_RDONLY | os.O_NONBLOCK)
        self.to_zygote = -1
        self.container = None
        self.oom_file: Path | None = None
        self.last_oom = 0

    def connect(self, container, timeout: float = 60.0) -> None:
        """Open the zygote's input once the container's shell has it open for reading (its
        output is connected by then); SandboxUnavailable if the container exits first."""
        self.container = container
        path, deadline = os.path.join(self.fifos, "in"), time.monotonic() + timeout
        for attempt in itertools.count():
            try:
                self.to_zygote = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:  # ENXIO: no reader yet
                if e.errno != errno.ENXIO:
                    raise
            if attempt % 50 == 49:
                container.reload()
                if container.status == "exited" or time.monotonic() > deadline:
                    logs = container.logs().decode(errors="replace")[-500:]
                    raise SandboxUnavailable(f"the zygote's container did not start ({container.status}): {logs}")  # fmt: skip
            time.sleep(0.01)
        os.set_blocking(self.to_zygote, True)
        os.set_blocking(self.from_zygote, True)
        container.reload()
        self.oom_file = oom_counter(container.attrs["State"]["Pid"])

    def oom_kills(self) -> int:
        """From the container's memory cgroup, read on the host (/sys is hidden inside)."""
        try:
            if self.oom_file is not None:
                self.last_oom = oom_kill_count(self.oom_file) or 0
        except OSError:  # the container is gone: its last count stands
            pass
        return self.last_oom

    def leftover(self) -> bool:
        return False  # the zygote is the container's pid 1 and kills its descendants itself

    def alive(self) -> bool:
        return True  # a dead container shows up as a failed send, which relaunches it

    def close(self, graceful: bool = False) -> None:
        del graceful  # the container goes either way
        for fd in (self.to_zygote, self.from_zygote):
            if fd >= 0:
                os.close(fd)
        try:
            if self.container is not None:
                self.container.remove(force=True)
        except Exception as e:  # already gone is fine; anything else is worth a warning
            warnings.warn(
                f"could not remove container {self.container.short_id}: {e}",
                stacklevel=2,
            )
        shutil.rmtree(self.fifos, ignore_errors=True)


class DockerLauncher:
    """Docker: per-task image, same limits, one long-lived zygote container per worker; each
    solution runs as a fresh uid without capabilities, as under bwrap on a root host."""

    name = "docker"

    def __init__(self, limits: Limits, image: str = DOCKER_IMAGE, python: str = "python3"):
        try:
            import docker

            self.client = docker.from_env()
            self.client.ping()
        except Exception as e:
            raise SandboxUnavailable(f"docker engine not reachable: {e}") from None
        self.docker = docker
        self.limits, self.image, self.python = limits, image, python
        self.host_tools = BwrapLauncher(limits) if shutil.which("bwrap") else None

    def tool_argv(self, binary: str, args: list[str]) -> list[str]:
        """One-shot tools (the linter) run under bwrap on the host where available."""
        return (
            self.host_tools.tool_argv(binary, args)
            if self.host_tools
            else [binary, *args]
        )

    def launch(self, image: str | None) -> Channel:
        mem = f"{self.limits.memory_mb + self.limits.tmpfs_mb + _CGROUP_OVERHEAD_MB}m"
        channel = DockerChannel()
        try:
            channel.connect(self._run(image or self.image, channel.fifos, mem))
        except BaseException:
            channel.close()
            raise
        uid = next(_SOLUTION_UIDS)  # not the host's: RLIMIT_NPROC counts per uid, host-wide
        hello(channel, "/tmp", [SANDBOX_PYLIB], isolated=True, timeout=60.0, uid=uid)
        return channel

    def _run(self, image: str, fifos: str, mem: str):
        """The zygote's container, started on the FIFOs of `fifos`."""
        zygote = [self.python, *_PYTHON_FLAGS, "/harness/zygote.py"]
        return self.client.containers.run(
            image,
            ["/bin/sh", "-c", 'exec "$@" >/channel/out </channel/in', "sh", *zygote],
            detach=True,
            network_mode="none",
            sysctls={"net.ipv4.ip_unprivileged_port_start": "1024"},  # docker's default: 0
            mem_limit=mem,
            memswap_limit=mem,
            pids_limit=self.limits.max_procs + 8,
            read_only=True,
            # an empty /sys, as under bwrap (the host reads the OOM kills, DockerChannel)
            tmpfs={"/tmp": f"size={self.limits.tmpfs_mb}m,mode=1777", "/sys": "ro,size=4k"},
            volumes={
                fifos: {"bind": "/channel", "mode": "ro"},
                str(GUEST_DIR): {"bind": "/harness", "mode": "ro"},
                **{
                    path: {"bind": f"{SANDBOX_PYLIB}/{name}", "mode": "ro"}
                    for name, path in pytest_paths().items()
                },
            },
            cap_drop=["ALL"],
            cap_add=list(_ZYGOTE_CAPS),
            security_opt=["no-new-privileges"],
            user="0:0",
            working_dir="/tmp",
            environment={"HOME": "/tmp", "LANG": "C.UTF-8"},
        )


def make_launcher(backend: str, limits: Limits, **options) -> Launcher:
    launchers = {
        "bwrap": BwrapLauncher,
        "docker": DockerLauncher,
        "process": ProcessLauncher,
    }
    if backend not in launchers:
        raise ValueError(
            f"unknown sandbox backend {backend!r}; choose one of {', '.join(launchers)}"
        )
    return launchers[backend](limits, **options)
