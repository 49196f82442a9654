"""Persistent sessions: files persist between commands, which run isolated and limited."""

from __future__ import annotations

import os

import pytest

from rollouts.sandbox import Limits
from rollouts.sandbox.session import Session, SessionError, pytest_outcomes

REPO = {
    "pkg/__init__.py": "",
    "pkg/a.py": "def f():\n    return 1\n",
    "tests/test_a.py": "from pkg.a import f\n\ndef test_f():\n    assert f() == 1\n\ndef test_g():\n    assert f() == 2\n",
}


@pytest.fixture
def session():
    with Session(REPO, limits=Limits(wall_s=5, cpu_s=5, output_bytes=4096, tmpfs_mb=8)) as s:
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


def test_commands_are_isolated_limited_and_capped(session):
    net = session.exec("python -c \"import socket; socket.create_connection(('1.1.1.1', 53), 1)\"")
    assert net.exit_code != 0
    assert session.exec("touch /usr/x").exit_code != 0  # read-only root
    assert session.exec("cat /etc/shadow").exit_code != 0  # not bound
    slow = session.exec("sleep 30", timeout_s=0.5)
    assert slow.timed_out and slow.exit_code is None and slow.seconds < 5
    loud = session.exec("head -c 100000 /dev/zero | tr '\\0' a")
    assert loud.output_bytes == 100000 and len(loud.output) == 4096
    mem = session.exec("python -c \"x = bytearray(2 << 30)\"")  # over RLIMIT_AS
    assert mem.exit_code != 0 and "MemoryError" in mem.output
    big = session.exec("head -c 9000000 /dev/zero > big.bin")
    assert big.over_quota


def test_nothing_outlives_a_command(session):
    session.exec("(sleep 60 &) ; echo started")
    if session.cgroup is not None:
        assert session.cgroup.pids() == []


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


def test_unsupported_backend_is_named():
    with pytest.raises(Exception, match="docker"):
        Session(REPO, backend="docker")
