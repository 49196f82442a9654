"""A grain data source over tasks: shuffle, repeat, shard by process, checkpointable."""

from __future__ import annotations

from collections.abc import Sequence

from rollouts.tasks.task import Task


class TaskSource:
    """grain RandomAccessDataSource protocol over an in-memory task list."""

    def __init__(self, tasks: Sequence[Task]):
        self._tasks = list(tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    def __getitem__(self, index: int) -> Task:
        return self._tasks[index]


def task_dataset(
    tasks: Sequence[Task],
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
):
    """A grain IterDataset of tasks; `iter(ds)` has get_state()/set_state() for checkpoints.

    Shard with the trainer's `jax.process_index()/process_count()`: each process sees
    a disjoint slice. `num_epochs=None` repeats forever (reshuffled every epoch).
    """
    import grain

    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index {shard_index} not in [0, {shard_count})")
    ds = grain.MapDataset.source(TaskSource(tasks))[shard_index::shard_count]
    if shuffle:
        ds = ds.seed(seed).shuffle()
    return ds.repeat(num_epochs).to_iter_dataset()
