"""The task pool: draws go round the pool, solved tasks retire and fresh ones (then the
longest retired) take their slots, and what a batch draws depends on its index and version
alone: the same under any thread timing and after a resume from a checkpoint."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future

import jax.numpy as jnp
import pytest

from rollouts.orchestrator import Orchestrator, WeightStore
from rollouts.producer import Rollout, RolloutBatch
from rollouts.tasks import Task
from rollouts.tasks.pool import TaskPool


def tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", prompt=f"task {i}", entry_point="f", tests=()) for i in range(n)]


def test_draws_go_round_the_pool_in_a_fresh_order_each_pass():
    pool = TaskPool(tasks(11), size=5, retire_after=2, seed=3)
    passes = [[next(pool).id for _ in range(5)] for _ in range(4)]
    assert all(sorted(p) == sorted(passes[0]) for p in passes)  # each slot once a pass
    assert len({tuple(p) for p in passes}) > 1  # reshuffled
    again = TaskPool(tasks(11), size=5, retire_after=2, seed=3)
    assert [next(again).id for _ in range(20)] == [t for p in passes for t in p]
    assert pool.metrics() == {"tasks/pool_size": 5, "tasks/retired": 0, "tasks/unseen": 6}


def test_solved_tasks_retire_and_fresh_then_retired_ones_take_their_slots():
    pool = TaskPool(tasks(4), size=3, retire_after=2, seed=0)
    slots = pool.get_state()["slots"]
    a, b, c = (f"t{i}" for i in slots)
    (fresh,) = (f"t{i}" for i in pool.get_state()["fresh"])
    pool.record(0, [(a, True), (b, True), (c, False)])
    pool.record(1, [(a, True), (b, False), (c, True), (c, True)])  # two groups of c, both solved
    pool.record(2, [(a, True), (c, True), (c, False)])  # one of c's groups failed
    assert pool.apply(2) == {"tasks/pool_size": 3, "tasks/retired": 1, "tasks/unseen": 0}
    state = pool.get_state()
    assert state["retired"] == [int(a[1:])] and int(fresh[1:]) in state["slots"]
    assert state["streak"] == {str(int(b[1:])): 0, str(int(c[1:])): 1}
    assert pool.apply(3)["tasks/retired"] == 1  # a's report is ignored: it left the pool
    assert state["applied"] == 2 and pool.get_state()["applied"] == 3
    # with no fresh task left, the task retired longest ago comes back
    pool.record(3, [(c, True), (fresh, True)])
    pool.record(4, [(c, True), (fresh, True)])
    pool.apply(5)
    state = pool.get_state()
    assert sorted(state["slots"]) == sorted(int(x[1:]) for x in (a, b, c))
    assert state["retired"] == [int(fresh[1:])] and state["retirements"] == 3


def test_a_report_missing_before_its_version_draws_is_an_error():
    pool = TaskPool(tasks(3), size=2, retire_after=1)
    pool.record(0, [("t0", False)])
    pool.apply(1)
    with pytest.raises(RuntimeError, match="batch 1's outcomes were not recorded before version 3"):
        pool.apply(3)
    with pytest.raises(KeyError, match="'nope' is not in the task pool's task list"):
        pool.record(2, [("nope", True)])
    with pytest.raises(ValueError, match="ids repeat: \\['t0'\\]"):
        TaskPool(tasks(2) + tasks(1), size=2, retire_after=1)
    with pytest.raises(ValueError, match="tasks.pool.retire_after: must be >= 1"):
        TaskPool(tasks(2), size=2, retire_after=0)
    with pytest.raises(ValueError, match="missing \\['applied'"):
        pool.set_state({"next_index": 4})


def test_a_group_is_solved_when_every_rollout_the_policy_played_passed():
    def rollout(task, status, masked=False):
        return Rollout(task, [1], [2], [True], [0.0], "", 0.0, status, "stop", 0, masked=masked)

    groups = {"all": ["passed", "passed"], "one_failed": ["passed", "failed"],
              "infra": ["infra_error", "passed"], "only_infra": ["infra_error", "infra_error"]}
    rows = [rollout(task, status) for task, statuses in groups.items() for status in statuses]
    rows += [rollout("cut", "passed"), rollout("cut", "failed", masked=True)]
    batch = RolloutBatch(0, 2, rows, {})
    assert batch.group_outcomes() == [("all", True), ("one_failed", False), ("infra", True),
                                      ("only_infra", False), ("cut", False)]


def solved(task_id: str, version: int) -> bool:
    """Whether the policy of `version` solves a task every time: easy tasks always, the
    rest now and then."""
    i = int(task_id[1:])
    return i < 5 or (i * 7 + version) % 4 == 0


class PoolProducer:
    """Draws `per_batch` tasks from the pool and "plays" two rollouts of each, solved as
    `solved(task, version)` says, taking a random time to sample and to score."""

    def __init__(self, pool: TaskPool, per_batch: int, rng: random.Random):
        self.pool, self.per_batch, self.rng = pool, per_batch, rng
        self.params = None

    def update_weights(self, params):
        self.params = params

    def start(self, index, version):
        drawn = [next(self.pool) for _ in range(self.per_batch)]
        time.sleep(self.rng.uniform(0, 0.002))
        status = ["passed" if solved(t.id, version) else "failed" for t in drawn]
        rollouts = [Rollout(t.id, [1], [2], [True], [0.0], "", float(s == "passed"), s, "stop",
                            version) for t, s in zip(drawn, status) for _ in range(2)]
        future = Future()
        threading.Timer(self.rng.uniform(0, 0.002), future.set_result,
                        [RolloutBatch(version, 2, rollouts, {})]).start()
        return future

    def task_state(self):
        return self.pool.get_state()

    def close(self):
        pass


def train(k: int, timing: int, start: int = 0, stop: int = 14, state=None, queued=(),
          checkpoint_at: int | None = None):
    """The trainer's side as jaxagent.train.loop runs it: get, record, update, publish; ->
    (per step: the batch's tasks and pool metrics), the snapshot at `checkpoint_at`."""
    pool = TaskPool(tasks(13), size=4, retire_after=2, seed=5)
    if state is not None:
        pool.set_state(state)
    rng = random.Random(timing)
    store = WeightStore.like({"version": jnp.asarray(0)})
    store.publish(start, {"version": jnp.asarray(start)})
    steps, snapshot = {}, None
    with Orchestrator(PoolProducer(pool, 3, random.Random(timing + 1)), store, max_staleness=k,
                      start=start, stop=stop, queued=list(queued),
                      before_draw=pool.apply) as orch:
        for step in range(start, stop):
            batch, _ = orch.get(step)
            pool.record(step, batch.group_outcomes())
            time.sleep(rng.uniform(0, 0.002))  # the update
            steps[step] = ([r.task_id for r in batch.rollouts[::2]],
                           {k: v for k, v in batch.stats.items() if k.startswith("tasks/")})
            if step + 1 < stop:
                store.publish(step + 1, {"version": jnp.asarray(step + 1)})
            if step + 1 == checkpoint_at:
                snapshot = orch.snapshot(step + 1)
    return steps, snapshot


@pytest.mark.parametrize("k", [0, 1, 2])
def test_a_batch_draws_the_same_tasks_under_any_timing_and_after_a_resume(k):
    straight, _ = train(k, timing=0)
    assert straight[13][1]["tasks/retired"] >= 3  # the easy tasks retired
    assert straight == train(k, timing=1)[0]
    # a checkpoint after 6 steps: the pool's state and the scored batches of the next k steps
    _, snap = train(k, timing=2, stop=9, checkpoint_at=6)
    queued = [RolloutBatch.from_json(b) for b in snap["queued"]]
    resumed, _ = train(k, timing=3, start=6, state=snap["data"], queued=queued)
    assert resumed == {s: v for s, v in straight.items() if s >= 6}


@pytest.mark.slow  # two JAX processes joined over gloo, 5-11 s on 2 shared cores
def test_processes_sharing_one_pool_draw_what_one_process_draws(tmp_path):
    """Single completions on 2 processes: each process's pool hears every process's groups
    (gathered), so both pools stay the same and the global batches, in process order, are
    those of 1 process drawing both shares, retirements included. Agent runs: a pool per
    process over its own shard."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("pool_probe", Path(__file__).with_name("pool_probe.py"))
    pool_probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pool_probe)
    root = Path(__file__).resolve().parents[3]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))},
           "PYTHONPATH": str(root)}
    out = subprocess.run(["bash", str(root / "launch" / "local_multihost.sh"), "--logdir",
                          str(tmp_path), "2", "1", "--", sys.executable, pool_probe.__file__,
                          str(tmp_path), "2"],
                         env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    multi = [json.loads((tmp_path / f"process_{p}.json").read_text()) for p in range(2)]
    single = pool_probe.run(pool_probe.config(4), timing=7)
    assert multi[0]["state"] == multi[1]["state"] == single["state"]
    assert single["state"]["retirements"] >= 3  # the easy tasks retired and others came in
    assert [a + b for a, b in zip(multi[0]["draws"], multi[1]["draws"])] == single["draws"]
    # an agent run pools each process's own shard: disjoint, every task in one of them
    shards = [set(m["agent_pool"]) for m in multi]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(single["agent_pool"])
