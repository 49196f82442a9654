"""Resolve a `--tasks` argument: `humaneval`, `synthetic[:N[:SEED]]`, a JSONL path, or a
directory of feature-deletion tasks (DIR/ID/task.json)."""

from __future__ import annotations

from pathlib import Path

from rollouts.tasks.task import Task, TaskFormatError


def load_tasks(spec: str) -> list[Task]:
    from rollouts.tasks.deletion import load_deletion_tasks
    from rollouts.tasks.humaneval import humaneval_tasks
    from rollouts.tasks.jsonl import load_jsonl_tasks
    from rollouts.tasks.synthetic import synthetic_tasks

    if spec == "humaneval":
        return humaneval_tasks()
    if spec == "synthetic" or spec.startswith("synthetic:"):
        parts = spec.split(":")[1:]
        try:
            n, seed = (
                (int(parts[0]) if parts else 1000),
                (int(parts[1]) if len(parts) > 1 else 0),
            )
        except ValueError:
            raise TaskFormatError(
                f"bad task set {spec!r}: expected synthetic[:N[:SEED]] with integers"
            ) from None
        return synthetic_tasks(n, seed)
    if Path(spec).is_file():
        return load_jsonl_tasks(spec)
    if Path(spec).is_dir():
        return load_deletion_tasks(spec)
    raise TaskFormatError(
        f"unknown task set {spec!r}: use 'humaneval', 'synthetic[:N[:SEED]]', a JSONL file or a "
        "directory of deletion tasks"
    )
