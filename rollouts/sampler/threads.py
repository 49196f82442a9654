"""Host threads (CPU): XLA:CPU runs a small decode step's ops on one core, so a call's rows, or a
`Continuation`'s slots, are split over threads that each decode their share. Row ids stay
global, so the keys (per step and row) and outputs are those of one thread."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from rollouts.sampler.continuation import Continuation
from rollouts.sampler.decode import SampleOutput

if TYPE_CHECKING:
    from rollouts.sampler.sampler import Sampler


def generate_in_threads(run, prompts, shards: int, num_samples: int, row_offset: int, on_finish,
                        tokenizer) -> SampleOutput:
    """`run(prompts, documents, row_offset, on_finish)` (one batch of `Sampler.generate`) over
    `shards` threads, whole prompts each; outputs and on_finish's rows are those of one call."""
    t0 = time.perf_counter()
    bounds = np.linspace(0, len(prompts), shards + 1).astype(int)
    lock = threading.Lock()

    def finished(*args):
        with lock:
            on_finish(*args)

    with ThreadPoolExecutor(shards) as pool:
        parts = list(pool.map(
            lambda ab: run(prompts[ab[0]:ab[1]], None, row_offset + int(ab[0]) * num_samples,
                           on_finish and finished), zip(bounds, bounds[1:])))
    stats = {k: sum(p.stats[k] for p in parts) for k in parts[0].stats}
    stats.update(prefill_seconds=max(p.stats["prefill_seconds"] for p in parts),
                 seconds=time.perf_counter() - t0, host_threads=shards)
    return SampleOutput([t for p in parts for t in p.tokens],
                        [lp for p in parts for lp in p.logprobs],
                        [r for p in parts for r in p.finish_reasons], stats, tokenizer)


class ThreadedContinuation:
    """`Continuation`'s interface over parts that each hold a range of the slots with their own
    cache, turned in parallel host threads (CPU, see `Sampler.host_shards`). Slot i samples with the
    keys of row i, so the actions are those of one `Continuation`."""

    def __init__(self, sampler: Sampler, slots: int, parts: int, **kwargs):
        bounds = np.linspace(0, slots, parts + 1).astype(int)
        self.slots = slots
        self.parts = [Continuation(sampler, int(b - a), row_offset=int(a), **kwargs)
                      for a, b in zip(bounds, bounds[1:])]
        self._part_of = np.repeat(np.arange(parts), np.diff(bounds))

    def _locate(self, slot: int) -> tuple[Continuation, int]:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside [0, {self.slots})")
        part = self.parts[self._part_of[slot]]
        return part, slot - part.row_offset

    def start(self, slot: int, prompt) -> None:
        part, i = self._locate(slot)
        part.start(i, prompt)

    def append(self, slot: int, tokens) -> None:
        part, i = self._locate(slot)
        part.append(i, tokens)

    def release(self, slot: int) -> None:
        part, i = self._locate(slot)
        part.release(i)

    def turn(self) -> dict[int, tuple[list[int], np.ndarray, str]]:
        with ThreadPoolExecutor(len(self.parts)) as pool:
            outs = list(pool.map(Continuation.turn, self.parts))
        return {p.row_offset + i: action for p, out in zip(self.parts, outs)
                for i, action in out.items()}

    @property
    def stats(self) -> dict:
        return {k: sum(p.stats[k] for p in self.parts) for k in self.parts[0].stats}


def continuation(sampler: Sampler, slots: int, **kwargs) -> Continuation | ThreadedContinuation:
    """A `Continuation` of `slots` episodes, split over host threads where the sampler would
    split a batch of that many rows."""
    parts = sampler.host_shards(slots, slots)
    if parts == 1:
        return Continuation(sampler, slots, **kwargs)
    return ThreadedContinuation(sampler, slots, parts, **kwargs)
