"""What only the docker backend has: its engine, its image, its containers. The verdicts it
shares with bwrap are tested on both (test_hostile.py, test_bwrap.py, test_session.py)."""

from __future__ import annotations

import os
import subprocess

import pytest

from rollouts.sandbox import Limits, Sandbox, SandboxUnavailable, engine, image


def _containers() -> list[str]:
    return subprocess.run(["docker", "ps", "-aq", "--no-trunc"], capture_output=True, text=True,
                          check=True).stdout.split()  # fmt: skip


def test_a_stuck_sandbox_is_killed_and_its_container_removed(docker_image, humaneval):
    """A zygote that stops answering (here: its container paused) costs its run a `timeout`;
    the container is removed and the next run gets a fresh one."""
    task = humaneval["HumanEval/0"]
    ok = task.request(task.metadata["reference"])
    with Sandbox("docker", workers=1, limits=Limits(wall_s=1, cpu_s=1), image=docker_image) as sb:
        assert sb.submit(ok).result().passed
        stuck = sb._workers[0].channel.container
        stuck.pause()
        assert sb.submit(ok).result().status == "timeout"
        assert stuck.id not in _containers()
        assert sb.submit(ok).result().passed
    assert stuck.id not in _containers()


def test_solutions_run_as_a_fresh_uid_without_capabilities(docker_sandbox, humaneval):
    body = ("    import os\n    status = open('/proc/self/status').read()\n"
            "    return os.getuid(), [l for l in status.splitlines() if l.startswith('CapEff')]\n")  # fmt: skip
    result = docker_sandbox.submit(humaneval["HumanEval/0"].request(body)).result()
    got = result.message.split("got ", 1)[1]
    assert got.startswith("(1") and "'CapEff:\\t0000000000000000'" in got, result


def test_unreachable_engine_is_reported_clearly(monkeypatch):
    pytest.importorskip("docker")
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxUnavailable, match="docker engine not reachable"):
        Sandbox("docker", workers=1)


def test_the_private_engine_says_why_it_cannot_start(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match="no dockerd on PATH"), engine.private_engine():
        pass
    fake = tmp_path / "dockerd"
    fake.write_text("#!/bin/sh\necho 'failed to start daemon: no space' >&2\nexit 1\n")
    fake.chmod(0o755)
    if os.geteuid() == 0:
        with pytest.raises(SandboxUnavailable, match="exited with 1.*no space"), engine.private_engine():
            pass


def test_the_image_is_rebuilt_only_when_its_files_change(docker_image, tmp_path):
    assert image.host_image() == docker_image  # cached: the same tag, no import
    one, two = tmp_path / "a", tmp_path / "b"
    one.write_text("x")
    two.write_text("y")
    key = image.content_key([str(one), str(two)])
    assert image.content_key([str(one), str(two)]) == key
    one.write_text("xx")
    assert image.content_key([str(one), str(two)]) != key
