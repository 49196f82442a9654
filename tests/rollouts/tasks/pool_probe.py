"""The trainer's shared task pool (single completions: `jaxagent.train.build.task_pool` and
`task_stream`, `jaxagent.train.loop.pool_outcomes`) run for a few steps. Under
launch/local_multihost.sh, `python pool_probe.py OUT PROMPTS_PER_PROCESS` writes what each
process drew at each step, its pool's final state and the tasks an agent run would pool there
to OUT/process_I.json; `run` is the same in one process."""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxagent.config import Config, load_config
from jaxagent.train.build import task_pool, task_stream
from jaxagent.train.loop import pool_outcomes
from rollouts.orchestrator import Orchestrator, WeightStore
from rollouts.producer import Rollout, RolloutBatch
from rollouts.tasks import Task

STEPS, STALENESS, GROUP = 12, 1, 2


def config(prompts_per_process: int) -> Config:
    return load_config(None, [f"train.prompts_per_step={prompts_per_process}", "seed=5",
                              "tasks.pool.size=4", "tasks.pool.retire_after=2"])


def solved(task_id: str, version: int) -> bool:
    """Easy tasks are solved every time, the rest now and then (by the policy of `version`)."""
    i = int(task_id[1:])
    return i < 5 or (i * 7 + version) % 4 == 0


class Producer:
    """Draws this process's tasks of a batch and plays GROUP rollouts of each, after a random
    wait (each process's own thread timing)."""

    def __init__(self, task_iter, per_batch: int, rng: random.Random):
        self.task_iter, self.per_batch, self.rng = task_iter, per_batch, rng

    def update_weights(self, params):
        pass

    def start(self, index, version):
        drawn = [next(self.task_iter) for _ in range(self.per_batch)]
        rollouts = [Rollout(t.id, [1], [2], [True], [0.0], "", 0.0,
                            "passed" if solved(t.id, version) else "failed", "stop", version)
                    for t in drawn for _ in range(GROUP)]
        future = Future()
        threading.Timer(self.rng.uniform(0, 0.003), future.set_result,
                        [RolloutBatch(version, GROUP, rollouts, {})]).start()
        return future

    def task_state(self):
        return self.task_iter.get_state()

    def close(self):
        pass


def tasks() -> list[Task]:
    return [Task(id=f"t{i}", prompt=f"task {i}", entry_point="f", tests=()) for i in range(13)]


def run(cfg: Config, timing: int) -> dict:
    """{"draws": this process's task ids per step, "state": its pool's state at the end,
    "agent_pool": the tasks an agent run's pool would hold here}, as
    jaxagent.train.loop.run_rl drives the pool: record each batch's gathered outcomes, apply
    them before the draws of the weights trained on them."""
    train = tasks()
    pool = task_pool(cfg, train)
    task_iter = task_stream(cfg, train, pool)
    store = WeightStore.like({"version": jnp.asarray(0)})
    store.publish(0, {"version": jnp.asarray(0)})
    rng = random.Random(timing)
    draws = []
    producer = Producer(task_iter, cfg.train.prompts_per_step, random.Random(timing + 1))
    with Orchestrator(producer, store, max_staleness=STALENESS, start=0, stop=STEPS,
                      before_draw=pool.apply) as orchestrator:
        for step in range(STEPS):
            batch, _ = orchestrator.get(step)
            pool.record(step, pool_outcomes(batch, pool, shared=True))
            draws.append([r.task_id for r in batch.rollouts[::GROUP]])
            time.sleep(rng.uniform(0, 0.003))  # the update
            if step + 1 < STEPS:
                store.publish(step + 1, {"version": jnp.asarray(step + 1)})
    agent = load_config(None, ["agent.enabled=true", "tasks.pool.size=3"])
    return {"draws": draws, "state": pool.get_state(),
            "agent_pool": [t.id for t in task_pool(agent, train).tasks]}


if __name__ == "__main__":
    from sharding.config import DistributedConfig
    from sharding.distributed import initialize

    initialize(DistributedConfig())
    out = run(config(int(sys.argv[2])), timing=jax.process_index())
    Path(sys.argv[1], f"process_{jax.process_index()}.json").write_text(json.dumps(out))
