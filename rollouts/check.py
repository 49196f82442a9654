"""`jaxagent check-solutions`: grade a JSONL of completions, write one result per line.

The input is read and checked before any output is opened, and `--out` may not be an input.
Results are written in input order as they complete, to `<out>.partial`, which is renamed to
`<out>` when every line is graded: an interrupted or failing run keeps everything computed so
far there and never leaves a half-written `<out>`. A bad input line (not JSON, not UTF-8, a
missing field, an unknown task) becomes an `error` record naming the file, line and field;
the run goes on.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from rollouts.rewards import Reward, RewardConfig, Scorer
from rollouts.sandbox import Limits
from rollouts.tasks.task import Task


@dataclass(frozen=True)
class Submission:
    line: int
    task_id: str | None
    completion: str | None
    error: str = ""  # set when the line is unusable


@dataclass
class Summary:
    statuses: Counter = field(default_factory=Counter)
    bad_lines: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.statuses.values())


def read_submissions(path: str | Path, tasks: dict[str, Task]) -> Iterator[Submission]:
    with open(path, "rb") as f:  # decoded per line: one bad byte costs its line, not the file
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                yield _parse(raw, lineno, path, tasks)


def _parse(
    raw: bytes, lineno: int, path: str | Path, tasks: dict[str, Task]
) -> Submission:
    where = f"{path}:{lineno}"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Submission(lineno, None, None, f"{where}: not UTF-8 (byte {e.start + 1})")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return Submission(lineno, None, None, f"{where}: invalid JSON: {e.msg}")
    if not isinstance(obj, dict):
        return Submission(lineno, None, None, f"{where}: expected a JSON object")
    task_id, completion = obj.get("task_id"), obj.get("completion")
    if not isinstance(task_id, str):
        return Submission(
            lineno, None, None, f"{where}: field 'task_id': missing or not a string"
        )
    if not isinstance(completion, str):
        return Submission(
            lineno,
            task_id,
            None,
            f"{where}: field 'completion': missing or not a string",
        )
    if task_id not in tasks:
        return Submission(
            lineno, task_id, None, f"{where}: field 'task_id': unknown task {task_id!r}"
        )
    return Submission(lineno, task_id, completion)


def _record(sub: Submission, reward: Reward | None) -> dict:
    if reward is None:
        return {
            "task_id": sub.task_id,
            "passed": False,
            "reward": 0.0,
            "status": "error",
            "message": sub.error,
        }
    r = reward.result
    return {
        "task_id": sub.task_id,
        "passed": r.passed,
        "reward": reward.reward,
        "status": r.status,
        "tests_passed": r.tests_passed,
        "tests_total": r.tests_total,
        "seconds": round(r.seconds, 4),
        "message": r.message,
        "breakdown": reward.breakdown,
    }


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (also through links; False when either is missing)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).absolute() == Path(b).absolute()


def check_solutions(
    tasks: Sequence[Task],
    solutions: str | Path,
    out: str | Path,
    backend: str = "bwrap",
    workers: int | None = None,
    limits: Limits | None = None,
    config: RewardConfig | None = None,
    progress: bool = True,
) -> Summary:
    """Grade every line of `solutions`, writing JSON records to `out` in input order."""
    from rich.console import Console
    from rich.progress import Progress

    if same_file(out, solutions):
        raise ValueError(f"--out {out}: is the --solutions file; write the results elsewhere")
    by_id = {t.id: t for t in tasks}
    subs = list(read_submissions(solutions, by_id))
    summary = Summary()
    partial = Path(f"{out}.partial")
    with (Scorer(config, backend=backend, workers=workers, limits=limits) as scorer,
          open(partial, "w", encoding="utf-8") as out_file):
        futures: list[Future[Reward] | None] = [
            None if s.error else scorer.submit(by_id[s.task_id], s.completion)
            for s in subs
        ]
        with Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar:
            job = bar.add_task("checking solutions", total=len(subs))
            for sub, future in zip(subs, futures):
                record = _record(sub, future.result() if future else None)
                out_file.write(json.dumps(record) + "\n")
                out_file.flush()
                summary.statuses[record["status"]] += 1
                if sub.error:
                    summary.bad_lines.append(sub.error)
                bar.advance(job)
    os.replace(partial, out)
    return summary


def _deleted_bodies(task: Task) -> list:
    """The leak patterns of a deletion task's deleted bodies; [] for other tasks."""
    from rollouts.tasks.deletion import Target, deleted_bodies

    if not task.metadata.get("feature"):
        return []
    feature = [Target.parse(f) for f in task.metadata["feature"]]
    return deleted_bodies(json.loads(task.metadata["reference"]), feature)


def _grade_references(tasks: Sequence[Task], backend: str, workers: int | None,
                      limits: Limits | None, progress: bool = False) -> list:
    """Each task's reference solution graded in the sandbox (`RunResult`s, in order)."""
    from rich.console import Console
    from rich.progress import Progress

    results = []
    with (Scorer(None, backend=backend, workers=workers, limits=limits) as scorer,
          Progress(console=Console(stderr=True), disable=not progress, transient=True) as bar):
        futures = [scorer.submit(t, t.metadata["reference"]) for t in tasks]
        job = bar.add_task("grading references", total=len(futures))
        for future in futures:
            results.append(future.result().result)
            bar.advance(job)
    return results


def _has_reference(task: Task) -> bool:
    return isinstance(task.metadata.get("reference"), str)


def check_tasks(tasks: Sequence[Task], backend: str = "bwrap", workers: int | None = None,
                limits: Limits | None = None, progress: bool = True) -> list[str]:
    """One line per problem of a task set: a task with no reference solution, one whose tests
    do not pass its reference in the sandbox, and a deletion task whose repository, prompt or
    history (any commit of its bundle) still hold a copy of a deleted body
    (`rollouts.tasks.leaks`)."""
    from rollouts.tasks.deletion import history_leaks
    from rollouts.tasks.leaks import find_leaks

    graded = [t for t in tasks if _has_reference(t)]
    problems = [f"{t.id}: no reference solution to check" for t in tasks if not _has_reference(t)]
    for t in graded:
        bodies = _deleted_bodies(t)
        problems += [f"{t.id}: {leak}" for leak in find_leaks(bodies, {**t.files, "prompt": t.prompt})]
        if bodies and t.metadata.get("git_source"):
            problems += [f"{t.id}: {leak}" for leak in history_leaks(t.metadata["git_source"], bodies)]
    for t, r in zip(graded, _grade_references(graded, backend, workers, limits, progress)):
        if not r.passed:
            problems.append(f"{t.id}: the reference solution does not pass its tests: "
                            f"{r.status}: {r.message[:200]}")
    return problems


def task_stats(tasks: Sequence[Task], backend: str = "bwrap", workers: int | None = None,
               limits: Limits | None = None) -> list[dict]:
    """Per task: its target tests, how much code it asks for (deleted functions and their
    body lines, for deletion tasks), and whether its reference passes in the sandbox: the
    numbers to size a task set's difficulty by."""
    rows = []
    for t in tasks:
        targets = t.metadata.get("target_tests") or [c.name for c in t.tests]
        bodies = _deleted_bodies(t)
        rows.append({"task": t.id, "target_tests": len(targets),
                     "functions": len(t.metadata.get("feature", ())),
                     "body_lines": sum(b.lines for b in bodies)})
    graded = [(row, t) for row, t in zip(rows, tasks) if _has_reference(t)]
    results = _grade_references([t for _, t in graded], backend, workers, limits)
    for (row, _), r in zip(graded, results):
        row["reference_passes"] = r.passed
    return rows
