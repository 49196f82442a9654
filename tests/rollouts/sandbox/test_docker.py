"""What only the docker backend has: its engine, its image, its containers. The verdicts it
shares with bwrap are tested on both (test_hostile.py, test_bwrap.py, test_session.py)."""

from __future__ import annotations

import os
import subprocess
import zipfile

import pytest

from jaxagent.cli import main
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


OOM_IN_CHILDREN = """    import os, time
    for _ in range(4):  # 4 x 150 MB, each under RLIMIT_AS, together over the container's cap
        if os.fork() == 0:
            x = b"x" * (150 << 20)
            time.sleep(1)
            os._exit(0)
    for _ in range(4):
        os.wait()
"""


def test_an_oom_kill_in_the_container_is_counted_on_the_host(docker_hostile_sandbox, humaneval):
    """/sys is empty inside, as under bwrap: the host reads the container's memory cgroup."""
    def kills() -> int:
        return sum(w.channel.oom_kills() for w in docker_hostile_sandbox._workers if w.channel)

    docker_hostile_sandbox.map([humaneval["HumanEval/0"].request("    return True\n")] * 2)
    before = kills()
    result = docker_hostile_sandbox.submit(humaneval["HumanEval/0"].request(OOM_IN_CHILDREN)).result()
    assert not result.passed and kills() > before, result


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


def _wheel(folder, name: str, source: str) -> None:
    """A pure-Python wheel of one module, made by hand (no build backend, no network)."""
    dist = f"{name}-0.1.dist-info"
    files = {f"{name}.py": source, f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}  # fmt: skip
    record = "".join(f"{path},,\n" for path in [*files, f"{dist}/RECORD"])
    with zipfile.ZipFile(folder / f"{name}-0.1-py3-none-any.whl", "w") as whl:
        for path, text in {**files, f"{dist}/RECORD": record}.items():
            whl.writestr(path, text)


def test_build_image_installs_requirements_offline(docker_image, tmp_path, capsys):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "jxtiny", "ANSWER = 42\n")
    (tmp_path / "requirements.txt").write_text("jxtiny==0.1\n")
    argv = ["sandbox", "build-image", "--requirements", str(tmp_path / "requirements.txt"),
            "--find-links", str(wheels), "--tag", "jaxagent-test:requirements"]  # fmt: skip
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == "jaxagent-test:requirements"
    probe = "import sys; sys.path.append('/pylib'); import jxtiny; print(jxtiny.ANSWER)"
    run = subprocess.run(["docker", "run", "--rm", "--network", "none", "jaxagent-test:requirements",
                          "python3", "-S", "-c", probe], capture_output=True, text=True, check=False)  # fmt: skip
    assert run.stdout.strip() == "42", run.stderr
    assert main(["sandbox", "build-image", "--requirements", "r.txt"]) == 2
    assert "needs --tag" in capsys.readouterr().err
