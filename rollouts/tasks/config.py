"""The `tasks` section: which task set a single-completion run trains and evaluates on, and
the pool that retires solved training tasks or the mix that draws families by their signal
(any run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class TaskPoolConfig:
    size: int = 0  # training tasks in play at a time (rollouts.tasks.pool); 0: no pool
    retire_after: int = 2  # consecutive batches solved by every rollout before a task retires


@dataclass(frozen=True)
class TaskMixConfig:
    # draw families (task.metadata["family"]) by the share of their last `window` groups whose
    # rewards differed (rollouts.tasks.mix); 0: tasks in a seeded order, families as they come
    window: int = 0
    floor: float = 0.05  # each family's least share of the draws


@dataclass(frozen=True)
class TasksConfig:
    source: Literal["synthetic", "humaneval", "jsonl"] = "synthetic"
    path: str | None = None  # jsonl file
    num_train: int = 4000  # synthetic only
    num_eval: int = 200  # held-out tasks (synthetic: a disjoint seed)
    families: tuple[str, ...] = ()  # synthetic families; empty = all
    pool: TaskPoolConfig = field(default_factory=TaskPoolConfig)
    mix: TaskMixConfig = field(default_factory=TaskMixConfig)
