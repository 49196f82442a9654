from __future__ import annotations

import io
import tarfile

import pytest

from rollouts.tasks import TaskFormatError, load_repo_task


def _repo(tmp_path):
    root = tmp_path / "proj"
    (root / "tests").mkdir(parents=True)
    (root / "lib.py").write_text("def f():\n    return 1\n")
    (root / "tests" / "test_lib.py").write_text(
        "from lib import f\n\ndef test_f():\n    assert f() == 1\n"
    )
    return root


def test_directory_and_tarball_load_the_same_files(tmp_path):
    root = _repo(tmp_path)
    tar_path = tmp_path / "proj.tar.gz"
    with tarfile.open(tar_path, "w:gz") as tar:
        for p in sorted(root.rglob("*")):
            if p.is_file():
                tar.add(p, arcname=str(p.relative_to(root)))
    from_dir = load_repo_task(root, ["python", "-m", "pytest", "-q"])
    from_tar = load_repo_task(
        tar_path, ["python", "-m", "pytest", "-q"], task_id="proj"
    )
    assert from_dir.files == from_tar.files and set(from_dir.files) == {
        "lib.py",
        "tests/test_lib.py",
    }
    assert from_dir.test_command == (
        "python",
        "-m",
        "pytest",
        "-q",
    ) and from_dir.metadata["test_paths"] == ["tests"]


def test_unsafe_tarballs_and_missing_command_are_rejected(tmp_path):
    evil = tmp_path / "evil.tar"
    with tarfile.open(evil, "w") as tar:
        info = tarfile.TarInfo("../outside.py")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(TaskFormatError, match="escapes the repository"):
        load_repo_task(evil, ["pytest"])
    with pytest.raises(TaskFormatError, match="'test_command' must be a non-empty"):
        load_repo_task(_repo(tmp_path), [])
    with pytest.raises(TaskFormatError, match="not a directory or tarball"):
        load_repo_task(tmp_path / "missing", ["pytest"])


def test_binary_files_are_carried_and_links_and_size_refused(tmp_path, monkeypatch):
    repo = tmp_path / "r"
    (repo / "tests" / "data").mkdir(parents=True)
    (repo / "tests" / "data" / "logo.png").write_bytes(b"\x89PNG\xff\x00")
    (repo / "tests" / "test_a.py").write_text("def test_a():\n    assert True\n")
    task = load_repo_task(repo, ["python", "-m", "pytest", "tests"])
    assert task.files["tests/data/logo.png"] == b"\x89PNG\xff\x00"
    assert isinstance(task.files["tests/test_a.py"], str)
    (repo / "link.py").symlink_to(repo / "tests" / "test_a.py")
    with pytest.raises(TaskFormatError, match="link.py is a symbolic link"):
        load_repo_task(repo, ["python", "-m", "pytest", "tests"])
    (repo / "link.py").unlink()
    monkeypatch.setattr("rollouts.tasks.repo.MAX_REPO_BYTES", 20)
    with pytest.raises(TaskFormatError, match=r"36 bytes, over the 20 a task may carry \(largest file: "
                                              r"tests/test_a.py, 30\)"):
        load_repo_task(repo, ["python", "-m", "pytest", "tests"])
