"""The docker backend against a real engine; skipped (with the reason) where none runs."""

from __future__ import annotations

import pytest

from rollouts.sandbox import Limits, Sandbox, SandboxUnavailable


@pytest.fixture(scope="module")
def docker_sandbox():
    try:
        sb = Sandbox("docker", workers=1, limits=Limits(wall_s=3, cpu_s=3))
    except SandboxUnavailable as e:
        pytest.skip(f"no docker engine: {e}")
    with sb:
        yield sb


def test_docker_verdicts(docker_sandbox, humaneval):
    task = humaneval["HumanEval/0"]
    cases = {
        "passed": task.metadata["reference"],
        "failed": "    return None\n",
        "hack": "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n",
        "timeout": "    while True:\n        pass\n",
    }
    for status, completion in cases.items():
        assert docker_sandbox.submit(task.request(completion)).result().status == status


def test_docker_has_no_network(docker_sandbox, humaneval):
    body = (
        "    import socket\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
    )
    result = docker_sandbox.submit(humaneval["HumanEval/2"].request(body)).result()
    assert result.status == "failed", result


def test_unreachable_engine_is_reported_clearly(monkeypatch):
    pytest.importorskip("docker")
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxUnavailable, match="docker engine not reachable"):
        Sandbox("docker", workers=1)
