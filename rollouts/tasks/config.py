"""The `tasks` section: which task set a single-completion run trains and evaluates on, and
the pool that retires solved training tasks (any run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class TaskPoolConfig:
    size: int = 0  # training tasks in play at a time (rollouts.tasks.pool); 0: no pool
    retire_after: int = 2  # consecutive batches solved by every rollout before a task retires


@dataclass(frozen=True)
class TasksConfig:
    source: Literal["synthetic", "humaneval", "jsonl"] = "synthetic"
    path: str | None = None  # jsonl file
    num_train: int = 4000  # synthetic only
    num_eval: int = 200  # held-out tasks (synthetic: a disjoint seed)
    families: tuple[str, ...] = ()  # synthetic families; empty = all
    pool: TaskPoolConfig = field(default_factory=TaskPoolConfig)
