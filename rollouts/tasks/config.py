"""The `tasks` section: which task set a single-completion run trains and evaluates on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TasksConfig:
    source: Literal["synthetic", "humaneval", "jsonl"] = "synthetic"
    path: str | None = None  # jsonl file
    num_train: int = 4000  # synthetic only
    num_eval: int = 200  # held-out tasks (synthetic: a disjoint seed)
    families: tuple[str, ...] = ()  # synthetic families; empty = all
