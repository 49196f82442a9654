"""Persistent sessions: files persist between commands, which run isolated and limited, on bwrap
and docker alike."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollouts.sandbox import Limits, SandboxUnavailable
from rollouts.sandbox.session import (
    PYTEST_FLAGS,
    Session,
    SessionError,
    docker_argv,
    pytest_outcomes,
)

# (backend, docker's containers): a container per session (the default) or per command
MODES = {"bwrap": ("bwrap", "session"), "docker": ("docker", "session"),
         "docker-per-command": ("docker", "command")}  # fmt: skip
REPO = {
    "pkg/__init__.py": "",
    "pkg/a.py": "def f():\n    return 1\n",
    "tests/test_a.py": "from pkg.a import f\n\ndef test_f():\n    assert f() == 1\n\ndef test_g():\n    assert f() == 2\n",
}


@contextlib.contextmanager
def _session(request: pytest.FixtureRequest, mode: str, **options) -> Iterator[Session]:
    """A session in `mode` (MODES); docker's on the private engine, with the host-made image,
    its container known to `leftovers`."""
    backend, containers = MODES[mode]
    image = request.getfixturevalue("docker_image") if backend == "docker" else None
    try:
        s = Session(REPO, backend=backend, image=image, containers=containers, **options)
    except SandboxUnavailable as e:
        pytest.skip(f"{backend}: {e}")
    with s, contextlib.ExitStack() as stack:
        if s.container is not None:
            held = request.getfixturevalue("docker_sessions")
            held.append(s.container)
            stack.callback(held.remove, s.container)
        yield s


# A container per command (no longer the default) costs 3-4 s a test: under -m slow.
@pytest.fixture(params=["bwrap", "docker", pytest.param("docker-per-command", marks=pytest.mark.slow)])
def session(request):
    limits = Limits(wall_s=5, cpu_s=5, output_bytes=4096, tmpfs_mb=8)
    with _session(request, request.param, limits=limits) as s:
        yield s


def test_files_persist_between_commands_and_host_edits(session):
    assert session.exec("echo 41 > n.txt").exit_code == 0
    assert session.exec("cat n.txt").output.strip() == "41"
    session.write_text("n.txt", "42\n")
    assert session.exec("cat n.txt; pwd").output.split() == ["42", "/work"]
    assert session.files()["n.txt"] == "42\n"


def test_pytest_runs_in_the_session_with_per_test_outcomes(session):
    result, outcomes = session.run_pytest(["tests"])
    assert result.exit_code == 1
    assert outcomes["tests/test_a.py::test_f"][0] == "passed"
    assert outcomes["tests/test_a.py::test_g"][0] == "failed"
    # skips by node id (a test, a parameter, a module skipped as it is collected), xfails
    session.write_text("tests/test_b.py", "import pytest\n\n@pytest.mark.parametrize('a', [1, 2])\n"
                       "def test_p(a):\n    if a == 2:\n        pytest.skip('two')\n\n"
                       "@pytest.mark.xfail(reason='bug')\ndef test_x():\n    assert 0\n")
    session.write_text("tests/test_c.py", "import pytest\npytest.importorskip('no_such_module')\n")
    _, outcomes = session.run_pytest(["tests"])
    assert {t: kind for t, (kind, _) in outcomes.items() if "test_a" not in t} == {
        "tests/test_b.py::test_p[1]": "passed", "tests/test_b.py::test_p[2]": "skipped",
        "tests/test_b.py::test_x": "xfail", "tests/test_c.py": "skipped"}


def test_a_test_run_in_the_command_server_is_a_fresh_pytest(session):
    """bwrap runs pytest in a fork of the session's command server: the same outcomes, exit
    status and failure text as `python -m pytest` in a process of its own; the repository's
    modules come first, even where the harness has one of that name."""
    session.write_text("wire.py", "VALUE = 7\n")
    session.write_text("tests/test_w.py", "import wire\n\ndef test_w():\n    assert wire.VALUE == 7\n")
    result, outcomes = session.run_pytest(["tests"])
    fresh = session.exec(["python", "-m", "pytest", "tests", *PYTEST_FLAGS])
    assert outcomes == pytest_outcomes(fresh.output) and len(outcomes) == 3
    assert outcomes["tests/test_w.py::test_w"][0] == "passed"
    assert result.exit_code == fresh.exit_code == 1
    assert "assert 1 == 2" in result.output and "assert 1 == 2" in fresh.output
    none, _ = session.run_pytest(["tests", "-k", "no_such_test"])
    assert none.exit_code == 5  # pytest's "no tests collected"


def test_the_command_server_prints_what_a_fresh_pytest_prints(session):
    """Word for word, but the durations: the agent reads this text (pytest 9.1+ warned of
    `console_main` into a collection error's report, the harness's path with it)."""
    session.write_text("broken.py", "if True:\nX = 1\n")
    session.write_text("tests/test_x.py", "import broken\n")

    def text(output: str) -> str:
        return re.sub(r"in [0-9.]+s", "in Ts", output)

    result, _ = session.run_pytest(["tests"])
    fresh = session.exec(["python", "-m", "pytest", "tests", *PYTEST_FLAGS])
    assert result.exit_code == fresh.exit_code == 2
    assert "IndentationError" in result.output and "harness" not in result.output
    assert text(result.output) == text(fresh.output)


def test_a_failure_s_reason_is_whole_on_any_host(session):
    """pytest trims a short-summary reason to the terminal's width; every backend runs it at
    one fixed, wide one, so a line of ~180 characters stays whole, whatever the host's
    terminal."""
    why = "`MARGIN` should be 41 " + "x" * 80
    session.write_text("tests/test_long.py",
                       f"def test_a_rather_long_test_name_here():\n    assert 0, {why!r}\n")
    _, outcomes = session.run_pytest(["tests/test_long.py"])
    assert outcomes == {"tests/test_long.py::test_a_rather_long_test_name_here": (
        "failed", f"AssertionError: {why}")}


def test_a_renewed_session_holds_the_new_files_alone(session):
    session.exec("echo x > left.txt && mkdir -p d/e && touch d/e/f && chmod 000 d")
    session.renew({"only.py": "A = 1\n"})
    assert session.files() == {"only.py": "A = 1\n"}
    assert session.exec("ls -A").output.split() == ["only.py"]


def test_a_dead_command_server_is_replaced(request):
    with _session(request, "bwrap") as s:
        assert s.exec("echo one").output == "one\n"
        s.server.channel.proc.kill()  # bwrap; the server dies with it
        s.server.channel.proc.wait()
        deadline = time.monotonic() + 5
        while s.cgroup is not None and s.cgroup.pids() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert s.exec("echo two").output == "two\n"
        assert s.run_pytest(["tests"])[1]["tests/test_a.py::test_f"][0] == "passed"


def test_commands_are_isolated_limited_and_capped(session):
    net = session.exec("python -c \"import socket; socket.create_connection(('1.1.1.1', 53), 1)\"")
    assert net.exit_code != 0
    assert session.exec("touch /usr/x").exit_code != 0  # read-only root
    if session.backend == "bwrap":  # a container has its image's own /etc
        assert session.exec("cat /etc/shadow").exit_code != 0  # not bound
    slow = session.exec("sleep 30", timeout_s=0.5)
    assert slow.timed_out and slow.exit_code is None and slow.seconds < 5
    loud = session.exec("head -c 100000 /dev/zero | tr '\\0' a")
    assert loud.output_bytes == 100000 and len(loud.output) == 4096
    mem = session.exec("python -c \"x = bytearray(2 << 30)\"")  # over RLIMIT_AS
    assert mem.exit_code != 0 and "MemoryError" in mem.output
    big = session.exec("head -c 9000000 /dev/zero > big.bin")
    assert big.over_quota


def test_nothing_outlives_a_command(session, leftovers):
    session.exec("true")
    idle = session.cgroup.pids() if session.cgroup is not None else []  # bwrap's command server
    session.exec("(sleep 60 &) ; echo started")
    if session.cgroup is not None:
        assert session.cgroup.pids() == idle
    assert session.exec("sleep 30", timeout_s=0.5).timed_out
    # a command that kills what runs it (docker sessions: the wrapper that would clean up)
    session.exec("(sleep 60 &) ; kill -9 $PPID; sleep 1")
    assert leftovers() == []  # docker: no container either, the timed-out one included
    assert session.exec("echo x > /tmp/mine && ls /tmp").output == "mine\n"
    assert session.exec("ls -A /tmp").output == ""  # each command gets an empty /tmp


FORK_ALL = """import os, time
n = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    n += 1
print(n)
"""


def test_a_command_gets_the_same_process_limit_everywhere(session):
    """RLIMIT_NPROC counts the uid's processes: the command and max_procs - 1 children, on
    every backend (a session container's init and wrapper, the same uid, are allowed for)."""
    if os.geteuid() != 0:
        pytest.skip("the command runs as our own uid, whose other processes count too")
    result = session.exec(["python", "-c", FORK_ALL])
    assert result.output.strip() == str(session.limits.max_procs - 1), result.output


def test_paths_cannot_escape_the_work_dir(session):
    session.exec("ln -s /etc/hostname host; mkfifo pipe; mkdir d")
    for bad in ("/etc/passwd", "../x", "host"):
        with pytest.raises(SessionError):
            session.read_text(bad)
    with pytest.raises(SessionError, match="not a regular file"):
        session.read_text("pipe")
    with pytest.raises(SessionError, match="does not exist"):
        session.read_text("missing.py")
    with pytest.raises(SessionError, match="directory"):
        session.write_text("d", "x")
    assert "host" not in session.files()


def _container_exists(name: str) -> bool:
    return bool(subprocess.run(["docker", "ps", "-aq", "--filter", f"name=^{name}$"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip


def test_a_revoked_docker_exec_runs_nothing(request):
    """A command's `docker exec` that the engine starts only after the command timed out and
    was cleaned up finds its token revoked."""
    with _session(request, "docker") as s:
        late = s.container.exec_argv(["sh", "-c", "echo ran > ran.txt"])
        s.container.clean()  # what a timeout does
        run = subprocess.run(late, capture_output=True, text=True, check=False)
        assert run.returncode != 0 and "a revoked command, not run" in run.stderr
        assert not (s.root / "ran.txt").exists()
        assert s.exec("echo ok").output == "ok\n"


def test_the_session_container_goes_with_its_session(request, tmp_path):
    """Removed at close, when the session is dropped unclosed, and when its host process dies
    (the container's init sees the host's end of its lifeline close)."""
    with _session(request, "docker") as s:
        name = s.container.name
        assert _container_exists(name)
    assert not _container_exists(name)
    dropped = Session({}, backend="docker", image=request.getfixturevalue("docker_image"))
    name, folder = dropped.container.name, dropped._tmp
    del dropped
    gc.collect()
    assert not _container_exists(name)
    shutil.rmtree(folder)  # the work dir is the host's: it stays until close
    root = Path(__file__).resolve().parents[3]
    start = ("import sys, time; from rollouts.sandbox.session import Session; "
             "s = Session({}, backend='docker', image=sys.argv[1]); "
             "print(s.container.name, flush=True); time.sleep(60)")  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path),  # where the dead host's work dir stays
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    host = subprocess.Popen([sys.executable, "-c", start, request.getfixturevalue("docker_image")],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=root)  # fmt: skip
    name = host.stdout.readline().strip()
    assert _container_exists(name)
    host.kill()
    host.wait()
    host.stdout.close()
    deadline = time.monotonic() + 20
    while _container_exists(name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _container_exists(name)


def test_a_forked_child_neither_keeps_nor_removes_the_container(request, tmp_path):
    """A child forked from the host that outlives it does not keep the container alive, and
    a forked child's own exit (atexit included) does not remove its parent's container."""
    root = Path(__file__).resolve().parents[3]
    start = ("import os, sys, time; from rollouts.sandbox.session import Session; "
             "s = Session({}, backend='docker', image=sys.argv[1]); "
             "pid = os.fork()\n"
             "if pid == 0: sys.exit(0)\n"  # a child that exits normally, finalizers and all
             "os.waitpid(pid, 0); sleeper = os.fork()\n"
             "if sleeper == 0: time.sleep(60); os._exit(0)\n"  # one that outlives the host
             "print(s.container.name, sleeper, s.exec('echo ok').output.strip(), flush=True); "
             "time.sleep(60)")  # fmt: skip
    env = {**os.environ, "TMPDIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    host = subprocess.Popen([sys.executable, "-c", start, request.getfixturevalue("docker_image")],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=root)  # fmt: skip
    name, sleeper, ok = host.stdout.readline().split()
    try:
        assert ok == "ok" and _container_exists(name)  # the first child's exit removed nothing
        host.kill()
        host.wait()
        deadline = time.monotonic() + 20
        while _container_exists(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _container_exists(name)
        os.kill(int(sleeper), 0)  # the sleeper still runs: the container went without it
    finally:
        host.stdout.close()
        try:
            os.kill(int(sleeper), signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_containers_mode_is_checked():
    with pytest.raises(ValueError, match="containers must be one of .*not 'pod'"):
        Session(REPO, containers="pod")


def test_close_removes_the_work_dir():
    s = Session(REPO)
    root = s.root
    assert root.is_dir()
    s.close()
    assert not os.path.exists(root)


def test_pytest_outcomes_parses_the_short_summary():
    out = "PASSED t.py::a\nFAILED t.py::b - assert 1 == 2\nERROR t.py::c\nnoise\n"
    assert pytest_outcomes(out) == {
        "t.py::a": ("passed", ""), "t.py::b": ("failed", "assert 1 == 2"), "t.py::c": ("error", "")}
    # parametrized ids with spaces, " - " and brackets inside them (pytest 8's own lines)
    out = ("PASSED tests/t.py::test_p[a b]\nSKIPPED tests/t.py::test_p[e] - Skipped: why not\n"
           "XFAIL tests/t.py::test_x[f g] - nope\n"
           "FAILED tests/t.py::test_p[c - d] - AssertionError: assert 'c - d' != 'c ...\n"
           "PASSED tests/t.py::test_q[[1, 2] - x]\n")
    assert pytest_outcomes(out) == {
        "tests/t.py::test_p[a b]": ("passed", ""),
        "tests/t.py::test_p[e]": ("skipped", "Skipped: why not"),
        "tests/t.py::test_x[f g]": ("xfail", "nope"),
        "tests/t.py::test_p[c - d]": ("failed", "AssertionError: assert 'c - d' != 'c ..."),
        "tests/t.py::test_q[[1, 2] - x]": ("passed", "")}


def test_unsupported_backend_is_named():
    with pytest.raises(SandboxUnavailable, match="bwrap, docker and process backends, not 'vm'"):
        Session(REPO, backend="vm")


def test_docker_without_an_engine_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="no `docker` CLI on PATH"):
        Session(REPO, backend="docker")
    # A CLI whose engine is down (as on this project's CI machines): its error is passed on.
    cli = tmp_path / "docker"
    cli.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    cli.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="engine not reachable: Cannot connect"):
        Session(REPO, backend="docker")


def test_docker_command_carries_the_single_run_limits():
    limits = Limits(wall_s=5, memory_mb=256, tmpfs_mb=16, max_procs=32)
    argv = docker_argv(["sh", "-c", "echo hi"], name="c1", image="img:1", workdir="/w",
                       limits=limits, tools={"ruff": "/opt/ruff"}, uid=1234)
    flags = " ".join(argv)
    for part in ("run --rm --name c1", "--network none", "--read-only",
                 "--tmpfs /tmp:size=16m", "--pids-limit 40", "--cap-drop ALL",
                 "--security-opt no-new-privileges", "--volume /w:/work:rw",
                 "--volume /opt/ruff:/tools/ruff:ro", "--workdir /work",
                 "--user 1234:1234"):
        assert part in flags, part
    assert argv[argv.index("--memory") + 1] == argv[argv.index("--memory-swap") + 1]
    image = argv.index("img:1")
    assert argv[image + 1] == "python3" and argv[-3:] == ["sh", "-c", "echo hi"]
    assert json.loads(argv[-4]) == {**dataclasses.asdict(limits), "solution_uid": 1234}


# Shell commands an agent may run to escape: each exits 0 only if it worked.
SESSION_ATTACKS = {
    "root_uid": "test \"$(id -u)\" = 0",
    "capabilities": "grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status | grep -qv 0000000000000000",
    "write_tool": "echo x >> /tools/tool",
    "remount_tool_rw": "python -c \"import ctypes; l = ctypes.CDLL(None, use_errno=True); "
    "raise SystemExit(l.mount(None, b'/tools/tool', None, 32 | 4096, None))\" && echo x >> /tools/tool",
    "tmpfs_over_harness": "python -c \"import ctypes; l = ctypes.CDLL(None); "
    "raise SystemExit(l.mount(b'x', b'/harness', b'tmpfs', 0, None))\"",
    "write_harness": "echo x >> /harness/limited.py",
    "write_pylib": "echo x >> /pylib/pytest/__init__.py",
    "new_user_namespace": "python -c \"import ctypes; raise SystemExit(ctypes.CDLL(None).unshare(0x10000000))\"",
    "setuid_binary": "su -c true",
    "core_pattern": "echo '|/tmp/x' > /proc/sys/kernel/core_pattern",
    "see_host_processes": "test $(ls /proc | grep -c '^[0-9]') -gt 8",
}


# A container per command makes docker's 11 runs (3 commands each) slow: ~20 s.
@pytest.mark.parametrize("mode", ["bwrap", "docker",
                                  pytest.param("docker-per-command", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(SESSION_ATTACKS))
def test_session_commands_hold_no_privilege(request, tmp_path, name, mode):
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\necho tool\n")
    tool.chmod(0o755)
    with _session(request, mode, tools={"tool": str(tool)}) as s:
        result = s.exec(SESSION_ATTACKS[name])
        assert result.exit_code != 0, (name, result.output)
        assert s.exec("tool").output.strip() == "tool"  # the bound tool still runs
        assert s.exec("echo ok > mine.txt && cat mine.txt").output.strip() == "ok"
    assert tool.read_text() == "#!/bin/sh\necho tool\n"
