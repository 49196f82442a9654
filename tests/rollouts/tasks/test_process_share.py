"""ProcessShare: every process's share of one global task stream."""

import pytest

from rollouts.tasks import synthetic_tasks, task_dataset
from rollouts.tasks.source import ProcessShare


def test_shares_in_process_order_are_the_global_batches():
    tasks = synthetic_tasks(30, seed=2)
    single = ProcessShare(iter(task_dataset(tasks, seed=4)), 0, 1, per_batch=6)
    shares = [ProcessShare(iter(task_dataset(tasks, seed=4)), p, 3, per_batch=2) for p in range(3)]
    for _ in range(4):  # four global batches of 6
        want = [next(single).id for _ in range(6)]
        got = [next(s).id for s in shares for _ in range(2)]
        assert got == want
    state = shares[1].get_state()
    after = [next(shares[1]).id for _ in range(2)]
    shares[1].set_state(state)
    assert [next(shares[1]).id for _ in range(2)] == after
    next(shares[1])
    with pytest.raises(RuntimeError, match="inside a batch"):
        shares[1].get_state()
    with pytest.raises(ValueError, match="process index 3"):
        ProcessShare(iter(task_dataset(tasks)), 3, 3, per_batch=2)
