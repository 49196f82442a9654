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


class ProcessShare:
    """This process's share of a global task stream: every `per_batch * count` tasks of
    `tasks` (one global batch, the same in every process) are cut into `count` runs of
    `per_batch` and process `index` gets run `index`. So the global batch, in process order,
    is the same whatever the number of processes. get_state/set_state at batch boundaries."""

    def __init__(self, tasks, index: int, count: int, per_batch: int):
        if not 0 <= index < count:
            raise ValueError(f"process index {index} not in [0, {count})")
        self.tasks, self.index, self.count, self.per_batch = tasks, index, count, per_batch
        self._mine: list = []

    def __iter__(self):
        return self

    def __next__(self):
        if not self._mine:
            batch = [next(self.tasks) for _ in range(self.per_batch * self.count)]
            self._mine = batch[self.index * self.per_batch:(self.index + 1) * self.per_batch]
        return self._mine.pop(0)

    def get_state(self):
        if self._mine:
            raise RuntimeError("ProcessShare.get_state inside a batch: take whole batches")
        return self.tasks.get_state()

    def set_state(self, state) -> None:
        self._mine = []
        self.tasks.set_state(state)
