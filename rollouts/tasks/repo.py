"""Repository tasks: a directory or tarball plus a pytest command.

The repository is read into memory as the task's pristine files: UTF-8 text as str, any other
file as bytes (carried to the sandbox byte for byte, never shown to the model as text), within
MAX_REPO_BYTES; a symbolic link is refused (a task is plain files). A completion
is a JSON object {path: new content}; the sandbox writes the pristine files,
then the edits, and scores `hack` for edits under `test_paths`, outside the
repository, or to conftest/pytest config/`.pth` files. The tests run with
pytest in the sandbox (`python -m pytest ARGS` from the repository root).
"""

from __future__ import annotations

import dataclasses
import tarfile
from pathlib import Path, PurePosixPath

from rollouts.tasks.task import Task, TaskFormatError, pytest_args

MAX_REPO_BYTES = 16 << 20


def _check_member(name: str, source: str) -> str:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts:
        raise TaskFormatError(f"{source}: member {name!r} escapes the repository")
    return str(path)


def _read_dir(root: Path) -> dict[str, bytes]:
    """The repository's files; its .git directory is history, not content."""
    files = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if ".git" in rel.parts:
            continue
        if p.is_symlink():
            raise TaskFormatError(f"{root}: {rel} is a symbolic link; repositories must be "
                                  "plain files (copy what it points to)")
        if p.is_file():
            files[str(rel)] = p.read_bytes()
    return files


def _read_tar(path: Path) -> dict[str, bytes]:
    files = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            name = _check_member(member.name, str(path))
            if member.issym() or member.islnk():
                raise TaskFormatError(
                    f"{path}: member {name!r} is a link; repositories must be plain files"
                )
            if member.isfile():
                files[name] = tar.extractfile(member).read()
    return files


def load_repo_task(
    source: str | Path,
    test_command: list[str] | tuple[str, ...],
    task_id: str | None = None,
    prompt: str = "",
    test_paths: tuple[str, ...] = ("tests",),
    grading: str = "isolated",
) -> Task:
    """A Task whose `files` are the repository's text files, graded by `test_command`
    (`grading`: see `Task.grading`)."""
    path = Path(source)
    if path.is_dir():
        raw = _read_dir(path)
    elif path.is_file() and tarfile.is_tarfile(path):
        raw = _read_tar(path)
    else:
        raise TaskFormatError(f"{path}: not a directory or tarball")
    size = sum(len(b) for b in raw.values())
    if size > MAX_REPO_BYTES:
        largest = max(raw, key=lambda name: len(raw[name]))
        raise TaskFormatError(f"{path}: repository has {size:,} bytes, over the {MAX_REPO_BYTES:,} "
                              f"a task may carry (largest file: {largest}, {len(raw[largest]):,})")
    if not test_command:
        raise TaskFormatError(
            f"{path}: field 'test_command' must be a non-empty command"
        )
    if grading not in ("isolated", "in-process"):
        raise TaskFormatError(f"{path}: field 'grading' must be 'isolated' or 'in-process', not {grading!r}")
    try:
        pytest_args(tuple(test_command))
    except ValueError as e:
        raise TaskFormatError(f"{path}: field 'test_command': {e}") from None
    files: dict[str, str | bytes] = {}
    for name, data in raw.items():
        try:
            files[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            files[name] = data
    return Task(
        id=task_id or path.name,
        prompt=prompt,
        entry_point="",
        tests=(),
        files=files,
        repo=str(path),
        test_command=tuple(test_command),
        completion_mode="full",
        metadata={"test_paths": list(test_paths), "grading": grading},
    )


def choose_grading(task: Task, completion: str, sandbox) -> str:
    """"isolated" if `completion` (a known-good solution) passes with the tests in the grader,
    else "in-process" if it passes with pytest beside it (an API that cannot cross as plain
    data); TaskFormatError if it passes neither way. `sandbox`: a rollouts.sandbox.Sandbox."""
    results = {}
    for grading in ("isolated", "in-process"):
        request = dataclasses.replace(task.request(completion), grading=grading)
        results[grading] = sandbox.submit(request).result()
        if results[grading].passed:
            return grading
    raise TaskFormatError(
        f"task {task.id}: the reference solution fails in both grading modes: "
        f"{results['isolated'].message[:300]} | {results['in-process'].message[:300]}")
