from __future__ import annotations

import pytest

from rollouts.tasks import synthetic_tasks, task_dataset


def _ids(iterator, n):
    return [next(iterator).id for _ in range(n)]


def test_shards_are_disjoint_and_cover_every_task():
    tasks = synthetic_tasks(10, seed=0)
    shards = [
        list(task_dataset(tasks, seed=1, num_epochs=1, shard_index=i, shard_count=3))
        for i in range(3)
    ]
    ids = [t.id for shard in shards for t in shard]
    assert sorted(ids) == sorted(t.id for t in tasks)


def test_shuffled_repeated_and_checkpointable():
    tasks = synthetic_tasks(8, seed=0)
    it = iter(task_dataset(tasks, seed=3))
    first_epoch = _ids(it, 8)
    assert sorted(first_epoch) == sorted(t.id for t in tasks) and first_epoch != [
        t.id for t in tasks
    ]
    state = it.get_state()
    ahead = _ids(it, 5)
    it.set_state(state)
    assert _ids(it, 5) == ahead


def test_bad_shard_is_rejected():
    with pytest.raises(ValueError, match="shard_index 2 not in"):
        task_dataset(synthetic_tasks(2), shard_index=2, shard_count=2)
