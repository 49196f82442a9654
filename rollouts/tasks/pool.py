"""A task pool for saturated rewards: train on a few tasks at a time, retire the ones the
policy solves every time, and draw fresh ones in their place.

The pool holds `size` of the training tasks (its slots), taken in a seeded order; draws go
round the slots, in a fresh seeded order each pass. The trainer reports each batch's groups
(`record(step, outcomes)`: the task and whether every rollout of its group passed), and before
a batch's tasks are drawn the reports of the batches behind its weights are applied
(`apply(version)`: batches 0 .. version - 1), in batch order. So what a batch draws depends on
its index and version alone, never on thread timing, and a run resumed from a checkpoint
(whose task state is the pool's) draws what an uninterrupted one did.

A task solved by every rollout of its groups in `retire_after` consecutive batches it took
part in is retired: its slot takes the next task never pooled or, when none is left, the task
retired longest ago (the policy may since have forgotten it), so the pool never shrinks.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence

import numpy as np

from rollouts.tasks.task import Task


class BatchReports:
    """What a task stream whose draws follow the outcomes of earlier batches shares (above):
    the trainer's `record(step, outcomes)`, `apply(version)` before a batch's draw, and the
    checkpointable state. A subclass starts with `_start(tasks, state)` (a state with
    "applied") and defines `__next__`, `_apply(report)` (a batch's outcomes as (task index,
    value), in the batch's order) and `_metrics()`."""

    name = "task pool"  # in its errors

    def _start(self, tasks: Sequence[Task], state: dict) -> None:
        self.tasks = list(tasks)
        if not self.tasks:
            raise ValueError(f"a {self.name} needs at least one task")
        self._index = {t.id: i for i, t in enumerate(self.tasks)}
        if len(self._index) != len(self.tasks):
            seen = [t.id for t in self.tasks]
            twice = sorted({i for i in seen if seen.count(i) > 1})[:3]
            raise ValueError(f"a {self.name} follows tasks by id, and ids repeat: {twice}")
        self._state = state
        self._reports: dict[int, list[tuple[int, bool]]] = {}
        self._lock = threading.Lock()

    def __iter__(self):
        return self

    def record(self, step: int, outcomes: Sequence[tuple[str, bool]]) -> None:
        """Batch `step`'s groups as (task id, value), in the batch's order."""
        report = []
        for task_id, value in outcomes:
            if task_id not in self._index:
                raise KeyError(f"task {task_id!r} is not in the {self.name}'s task list")
            report.append((self._index[task_id], bool(value)))
        with self._lock:
            if step >= self._state["applied"]:
                self._reports[step] = report

    def apply(self, version: int) -> dict:
        """Apply the reports of batches before `version` (each recorded: the weights of
        `version` were trained on them), in batch order; returns the stream's metrics."""
        with self._lock:
            s = self._state
            for step in range(s["applied"], version):
                if step not in self._reports:
                    raise RuntimeError(f"{self.name}: batch {step}'s outcomes were not recorded "
                                       f"before version {version} drew")
                self._apply(self._reports.pop(step))
                s["applied"] = step + 1
            return self._metrics()

    def metrics(self) -> dict:
        with self._lock:
            return self._metrics()

    def index_of(self, task_id: str) -> int:
        return self._index[task_id]

    def get_state(self) -> dict:
        with self._lock:
            return copy.deepcopy(self._state)

    def set_state(self, state: dict) -> None:
        missing = set(self._state) - set(state)
        if missing:
            raise ValueError(f"{self.name} state: missing {sorted(missing)} (a checkpoint of a "
                             f"run without it?)")
        self._check_state(state)
        with self._lock:
            self._state = copy.deepcopy(state)
            self._reports = {}

    def _check_state(self, state: dict) -> None:
        """Raise ValueError where `state` (every key present) cannot be this stream's."""


class TaskPool(BatchReports):
    """An endless, checkpointable task iterator (get_state/set_state) that retires solved
    tasks; its reports are (task id, every rollout of the group passed)."""

    def __init__(self, tasks: Sequence[Task], size: int, retire_after: int, seed: int = 0):
        if size < 1:
            raise ValueError(f"tasks.pool.size: must be >= 1 to pool tasks, got {size}")
        if retire_after < 1:
            raise ValueError(f"tasks.pool.retire_after: must be >= 1, got {retire_after}")
        order = np.random.default_rng(seed).permutation(len(tasks)).tolist()
        n = min(size, len(tasks))
        self._start(tasks, {
            "slots": order[:n],  # the pooled tasks (indices into `tasks`)
            "fresh": order[n:],  # never pooled yet, next first
            "retired": [],  # oldest first
            "streak": {},  # task index (as str) -> consecutive batches solved every time
            "draws": 0,
            "applied": 0,  # the reports of batches before this one are applied
            "retirements": 0,
        })
        self.retire_after, self.seed = retire_after, seed

    def __next__(self) -> Task:
        with self._lock:
            s = self._state
            passes, i = divmod(s["draws"], len(s["slots"]))
            slot = np.random.default_rng([self.seed, passes]).permutation(len(s["slots"]))[i]
            s["draws"] += 1
            return self.tasks[s["slots"][slot]]

    def _apply(self, report: list[tuple[int, bool]]) -> None:
        # a task with several groups in the batch counts as solved if each was
        solved: dict[int, bool] = {}
        for task, value in report:
            solved[task] = solved.get(task, True) and value
        for task, value in sorted(solved.items()):
            self._update(task, value)

    def _update(self, task: int, solved: bool) -> None:
        s = self._state
        if task not in s["slots"]:
            return  # retired since it was drawn
        streak = s["streak"].get(str(task), 0) + 1 if solved else 0
        s["streak"][str(task)] = streak
        if streak < self.retire_after:
            return
        s["streak"].pop(str(task))
        s["retired"].append(task)
        s["retirements"] += 1
        queue = s["fresh"] or s["retired"]
        s["slots"][s["slots"].index(task)] = queue.pop(0)

    def _metrics(self) -> dict:
        """tasks/pool_size, tasks/retired (retirements so far), tasks/unseen (never pooled)."""
        s = self._state
        return {"tasks/pool_size": len(s["slots"]), "tasks/retired": s["retirements"],
                "tasks/unseen": len(s["fresh"])}

    def _check_state(self, state: dict) -> None:
        if any(i >= len(self.tasks) for i in state["slots"] + state["fresh"] + state["retired"]):
            raise ValueError("task pool state: names tasks beyond the task list (another task set?)")
