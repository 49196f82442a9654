"""Task records and loaders: HumanEval, JSONL, repositories, synthetic; grain source."""

from rollouts.tasks.humaneval import humaneval_tasks
from rollouts.tasks.jsonl import load_jsonl_tasks
from rollouts.tasks.registry import load_tasks
from rollouts.tasks.repo import load_repo_task
from rollouts.tasks.source import TaskSource, task_dataset
from rollouts.tasks.synthetic import synthetic_tasks
from rollouts.tasks.task import Task, TaskFormatError

__all__ = [
    "Task",
    "TaskFormatError",
    "TaskSource",
    "humaneval_tasks",
    "load_jsonl_tasks",
    "load_repo_task",
    "load_tasks",
    "synthetic_tasks",
    "task_dataset",
]
