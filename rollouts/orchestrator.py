"""Asynchronous rollouts: a producer thread samples ahead of the trainer by at most
`max_staleness` (k) policy versions.

    trainer:   step s trains batch s (a queue entry), then publishes weights version s + 1
    producer:  batch i is sampled with weights version max(i - k, first)

k = 0 is the synchronous schedule (batch i waits for the update before it); k = 1 is
one-step-off: batch i + 1 is sampled and scored while step i trains, so staleness (the step
minus the batch's version) is exactly k once the pipeline is full. Because the version a batch
uses is fixed by its index, not by thread timing, a run is reproducible and a resume repeats
an uninterrupted run.

Weights: the trainer publishes a copy (`jax.device_put`, never aliased: the train step donates
its own buffers; the store's `prepare` may move it onto the sampler's devices) into a
`WeightStore`, which keeps only the versions the producer may still ask for (at most k + 1: a
double buffer for k = 1). The sampler switches weights between batches, never inside one.

Rewards: `RolloutProducer.start` returns as soon as a batch is sampled, with a future of the
scored batch, so the sampler moves on while the sandbox runs that batch's tests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Self

import jax

from rollouts.producer import Producer, RolloutBatch


class Closed(RuntimeError):
    """The pipeline was shut down while a thread waited on it."""


def _copy(x: jax.Array, sharding, dtype) -> jax.Array:
    """`x` in `dtype` on `sharding`, in a buffer of its own: cast where the masters are (the
    smaller copy moves); a cast already made a fresh buffer, otherwise copy (never alias: the
    train step donates its own buffers)."""
    y = x.astype(dtype)
    return jax.device_put(y, sharding, may_alias=y is not x)


class WeightStore:
    """Versioned copies of the policy's parameters on the sampler's devices."""

    def __init__(self, shardings, dtypes=None, prepare=None):
        # a pytree of shardings, like the params: the sampler's, or where the copy is made
        # before `prepare` moves it there
        self.shardings = shardings
        # the sampler's dtypes (its compute dtype: float32 masters are published as bfloat16
        # copies, half the bytes); None keeps the published dtypes
        self.dtypes = dtypes
        # what the sampler's side makes of a published copy before keeping it (moves it onto
        # the sampler's mesh; LoRA: merges the adapters into its base); None keeps the copy
        self.prepare = prepare
        self._versions: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._closed = False

    @classmethod
    def like(cls, params, prepare=None) -> WeightStore:
        """A store whose copies keep `params`' shardings and dtypes (the sampler's weights)."""
        return cls(jax.tree.map(lambda x: x.sharding, params),
                   jax.tree.map(lambda x: x.dtype, params), prepare)

    def publish(self, version: int, params) -> float:
        """Copy `params` to the sampler's shardings (and dtypes) as `version`; returns the
        seconds taken."""
        t0 = time.perf_counter()
        dtypes = self.dtypes or jax.tree.map(lambda x: x.dtype, params)
        copy = jax.tree.map(_copy, params, self.shardings, dtypes)
        if self.prepare is not None:
            copy = self.prepare(copy)
        jax.block_until_ready(copy)
        with self._cond:
            self._versions[version] = copy
            self._cond.notify_all()
        return time.perf_counter() - t0

    def take(self, version: int):
        """Wait until `version` is published; return it and forget every older version."""
        with self._cond:
            self._cond.wait_for(lambda: version in self._versions or self._closed)
            if self._closed:
                raise Closed("weight store closed")
            for old in [v for v in self._versions if v < version]:
                del self._versions[old]
            return self._versions[version]

    def versions(self) -> list[int]:
        with self._cond:
            return sorted(self._versions)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._versions.clear()
            self._cond.notify_all()


class Orchestrator:
    """Runs `producer` in a thread for batches `start .. stop - 1`; the trainer calls
    `get(step)` for each step in order and `snapshot(done)` when it checkpoints.

    `queued`: batches restored from a checkpoint, for steps `start, start + 1, ...`; one whose
    staleness would exceed `max_staleness` is dropped (and counted in `dropped_stale`).
    `before_draw(version)`: called in the producer thread before each batch's tasks are drawn
    (and their state recorded), with the version the batch samples with; what it returns
    joins the batch's stats (a task pool applies the reports of the batches behind that
    version: `rollouts.tasks.pool`).
    """

    def __init__(self, producer: Producer, weights: WeightStore, *, max_staleness: int,
                 start: int, stop: int, queued: list[RolloutBatch] = (),
                 before_draw: Callable[[int], dict] | None = None):
        if max_staleness < 0:
            raise ValueError(f"rollout.max_staleness: must be >= 0, got {max_staleness}")
        self.producer, self.weights, self.before_draw = producer, weights, before_draw
        self.k, self.start_step, self.stop = max_staleness, start, stop
        self._cond = threading.Condition()
        self._items: dict[int, tuple[Future, float]] = {}  # index -> (future of batch, idle s)
        self._task_states: dict[int, Any] = {}  # index -> task-iterator state before its draw
        self._error: BaseException | None = None
        self._closed = False
        self.dropped_stale = 0
        for batch in queued:
            index = start + len(self._items)
            if index - batch.version > max_staleness:
                self.dropped_stale += 1
                continue
            self._items[index] = (_done(batch), 0.0)
        self._next = start + len(self._items)
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def version_for(self, index: int) -> int:
        # Weights older than the run's first step (a resume's checkpoint) no longer exist.
        return max(index - self.k, self.start_step)

    # -- producer thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            for index in range(self._next, self.stop):
                t0 = time.perf_counter()
                params = self.weights.take(self.version_for(index))
                idle = time.perf_counter() - t0
                self.producer.update_weights(params)
                stats = self.before_draw(self.version_for(index)) if self.before_draw else {}
                self._record_state(index)
                future = self.producer.start(index, self.version_for(index))
                if stats:
                    future = _with_stats(future, stats)
                with self._cond:
                    # The version gate already bounds the lead; this bounds memory as well.
                    self._cond.wait_for(lambda: len(self._items) <= self.k or self._closed)
                    if self._closed:
                        return
                    self._items[index] = (future, idle)
                    self._cond.notify_all()
            self._record_state(self.stop)
        except Closed:
            pass
        except BaseException as e:  # noqa: BLE001 - re-raised in the trainer's thread
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _record_state(self, index: int) -> None:
        state = self.producer.task_state()
        with self._cond:
            self._task_states[index] = state
            self._cond.notify_all()

    # -- trainer side ---------------------------------------------------------------------------

    def _wait(self, ready) -> None:
        """Wait (holding the lock) until `ready()`; raise if the producer failed or closed."""
        self._cond.wait_for(lambda: ready() or self._error is not None or self._closed)
        if not ready():
            if self._error is not None:
                raise RuntimeError("the rollout producer failed") from self._error
            raise Closed("orchestrator closed")

    def get(self, step: int) -> tuple[RolloutBatch, dict]:
        """The batch step `step` trains (waiting for it) and timing metrics."""
        t0 = time.perf_counter()
        with self._cond:
            self._wait(lambda: step in self._items)
            future, idle = self._items.pop(step)
            for old in [i for i in self._task_states if i < step]:
                del self._task_states[old]
            self._cond.notify_all()
        batch = future.result()
        return batch, {"time/wait_s": time.perf_counter() - t0, "time/sampler_idle_s": idle,
                       "rollout/dropped_stale": self.dropped_stale}

    def snapshot(self, done: int) -> dict:
        """What a checkpoint after `done` steps holds of the pipeline: the scored batches of the
        next min(k, stop - done) steps (they were sampled with weights older than the
        checkpoint's, which a resume could not recreate; waited for) and the task-iterator
        state before the first batch not saved."""
        saved = range(done, min(done + self.k, self.stop))
        with self._cond:
            self._wait(lambda: all(i in self._items for i in saved)
                       and saved.stop in self._task_states)
            futures = [self._items[i][0] for i in saved]
            state = self._task_states[saved.stop]
        return {"data": state, "queued": [f.result().to_json() for f in futures]}

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.weights.close()
        if self._thread.is_alive():
            self._thread.join()
        self.producer.close()


def _with_stats(future: Future, stats: dict) -> Future:
    """A future of `future`'s batch with `stats` added to its stats (before anyone sees it)."""
    out: Future = Future()

    def done(f: Future) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
        else:
            batch = f.result()
            batch.stats.update(stats)
            out.set_result(batch)

    future.add_done_callback(done)
    return out


def _done(batch: RolloutBatch) -> Future:
    future: Future = Future()
    future.set_result(batch)
    return future
