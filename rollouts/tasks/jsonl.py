"""Tasks from JSONL, one object per line (MBPP-style).

Schema (unknown fields are an error, so typos do not pass silently):
  task_id          str | int   required, unique
  prompt           str         required (MBPP alias: "text")
  entry_point      str         required: the function the tests call
  tests            [str, ...]  required, non-empty: trusted Python snippets, usually
                               `assert f(1) == 2`; `candidate` is bound too (alias: "test_list")
  test_setup       str         optional trusted code run before the tests (alias: "test_setup_code")
  completion_mode  "full" | "continue"   optional, default "full"
  reference        str         optional completion known to pass (alias: "code")
  files            {path: str} optional files written into the work dir
  metadata         {...}       optional free-form
"""

from __future__ import annotations

import json
from pathlib import Path

from rollouts.sandbox.types import TestCase
from rollouts.tasks.task import Task, TaskFormatError

_ALIASES = {
    "text": "prompt",
    "test_list": "tests",
    "test_setup_code": "test_setup",
    "code": "reference",
}
_REQUIRED = ("task_id", "prompt", "entry_point", "tests")
_OPTIONAL = ("test_setup", "completion_mode", "reference", "files", "metadata")


def _field_error(where: str, name: str, problem: str) -> TaskFormatError:
    return TaskFormatError(f"{where}: field {name!r}: {problem}")


def _str_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, str) for v in value)
    )


def _compiles(code: str, where: str, name: str) -> None:
    try:
        compile(code, name, "exec")
    except SyntaxError as e:
        raise _field_error(where, name, f"syntax error: {e.msg} (line {e.lineno})") from None


def parse_task(obj: object, where: str) -> Task:
    """One validated Task from a decoded JSON object; `where` is 'file:line' for errors."""
    if not isinstance(obj, dict):
        raise TaskFormatError(
            f"{where}: expected a JSON object, got {type(obj).__name__}"
        )
    rec = {_ALIASES.get(k, k): v for k, v in obj.items()}
    for key in rec:
        if key not in _REQUIRED and key not in _OPTIONAL:
            raise _field_error(where, key, "unknown field")
    for key in _REQUIRED:
        if key not in rec:
            raise _field_error(where, key, "missing")
    if not isinstance(rec["task_id"], (str, int)) or isinstance(rec["task_id"], bool):
        raise _field_error(where, "task_id", "expected a string or integer")
    for key in ("prompt", "entry_point"):
        if not isinstance(rec[key], str):
            raise _field_error(where, key, "expected a string")
    if not rec["entry_point"].isidentifier():
        raise _field_error(
            where, "entry_point", f"{rec['entry_point']!r} is not a Python identifier"
        )
    if not _str_list(rec["tests"]):
        raise _field_error(where, "tests", "expected a non-empty list of strings")
    for i, code in enumerate(rec["tests"]):  # a test that cannot compile would fail every solution
        _compiles(code, where, f"tests[{i}]")
    for key in ("test_setup", "reference"):
        if key in rec and not isinstance(rec[key], str):
            raise _field_error(where, key, "expected a string")
    if "test_setup" in rec:
        _compiles(rec["test_setup"], where, "test_setup")
    mode = rec.get("completion_mode", "full")
    if mode not in ("full", "continue"):
        raise _field_error(
            where, "completion_mode", f"expected 'full' or 'continue', got {mode!r}"
        )
    files = rec.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in files.items()
    ):
        raise _field_error(
            where, "files", "expected an object mapping paths to strings"
        )
    metadata = rec.get("metadata", {})
    if not isinstance(metadata, dict):
        raise _field_error(where, "metadata", "expected an object")
    task_id = str(rec["task_id"])
    if "reference" in rec:
        metadata = {**metadata, "reference": rec["reference"]}
    return Task(
        id=task_id,
        prompt=rec["prompt"],
        entry_point=rec["entry_point"],
        tests=tuple(
            TestCase(f"{task_id}#{i}", code) for i, code in enumerate(rec["tests"])
        ),
        test_setup=rec.get("test_setup", ""),
        files=files,
        completion_mode=mode,
        metadata=metadata,
    )


def load_jsonl_tasks(path: str | Path) -> list[Task]:
    """Tasks from a JSONL file; errors name the file, line and field."""
    tasks: list[Task] = []
    seen: dict[str, int] = {}
    with open(path, "rb") as f:  # decoded per line, so an error names the line
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise TaskFormatError(f"{where}: not UTF-8 (byte {e.start + 1})") from None
            except json.JSONDecodeError as e:
                raise TaskFormatError(f"{where}: invalid JSON: {e.msg}") from None
            task = parse_task(obj, where)
            if task.id in seen:
                raise _field_error(
                    where,
                    "task_id",
                    f"duplicate {task.id!r} (first on line {seen[task.id]})",
                )
            seen[task.id] = lineno
            tasks.append(task)
    return tasks
