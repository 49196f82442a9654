"""A family mix: draw task families in proportion to how often they still teach.

A group whose rewards are all equal (every episode passed, or none did) has no advantage and
no gradient (DAPO's dynamic-sampling filter); a family the policy always solves, or never,
spends a step's sampling for nothing. The mix draws each training task's family
(`task.metadata["family"]`: the template of the embedded agent family, the synthetic family)
with probability

    share_f = floor + (1 - F * floor) * signal_f / sum_g signal_g

where `signal_f` is the fraction of the family's last `window` groups whose rewards differed,
the slots it has not filled yet counted as signal (every family starts equal, and two silent
groups do not sink one: a first probe of this mix that counted only the groups seen put a
family at its floor after two, where it stayed) and `floor` keeps every family drawn, so one
that saturated is still watched and comes back if the policy forgets it. Within a family the
tasks go in a seeded order, a fresh one each pass. It is the "learnability" curriculum of
sampling where the success rate p makes p(1 - p) large (Foster & Foerster, 2025), measured
as what the update sees: a group with a signal.

The trainer reports each batch's groups as (task id, rewards differ); the reports behind a
batch's weights are applied before its draw (`BatchReports`), so a batch's draws depend on
its index and version alone, and a resumed run draws what an uninterrupted one did.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rollouts.tasks.pool import BatchReports
from rollouts.tasks.task import Task


class FamilyMix(BatchReports):
    """An endless, checkpointable task iterator drawing families by their recent signal."""

    name = "task mix"

    def __init__(self, tasks: Sequence[Task], window: int, floor: float, seed: int = 0):
        if window < 1:
            raise ValueError(f"tasks.mix.window: must be >= 1 to mix families, got {window}")
        unnamed = [t.id for t in tasks if "family" not in t.metadata][:3]
        if unnamed:
            raise ValueError(f"tasks.mix: tasks without metadata['family'] to mix by: {unnamed}")
        self.families = sorted({t.metadata["family"] for t in tasks})
        if not 0 <= floor <= 1 / max(len(self.families), 1):
            raise ValueError(f"tasks.mix.floor: must be in [0, 1/{len(self.families)}] for "
                             f"{len(self.families)} families, got {floor}")
        self._start(tasks, {
            "draws": 0,
            "applied": 0,  # the reports of batches before this one are applied
            "taken": [0] * len(self.families),  # tasks drawn from each family so far
            "signal": [[] for _ in self.families],  # each family's last `window` groups
        })
        self.members = [[i for i, t in enumerate(self.tasks) if t.metadata["family"] == f]
                        for f in self.families]
        self._family = {i: k for k, m in enumerate(self.members) for i in m}
        self.window, self.floor, self.seed = window, floor, seed

    def shares(self) -> np.ndarray:
        """[F] the draw probability of each family (`families` order)."""
        signal = np.asarray([(sum(h) + self.window - len(h)) / self.window
                             for h in self._state["signal"]])
        n = len(signal)
        base = signal / signal.sum() if signal.sum() > 0 else np.full(n, 1 / n)
        return self.floor + (1 - n * self.floor) * base

    def __next__(self) -> Task:
        with self._lock:
            s = self._state
            shares = self.shares()
            k = int(np.random.default_rng([self.seed, s["draws"]]).choice(
                len(shares), p=shares / shares.sum()))
            s["draws"] += 1
            passes, i = divmod(s["taken"][k], len(self.members[k]))
            s["taken"][k] += 1
            order = np.random.default_rng([self.seed, k, passes]).permutation(len(self.members[k]))
            return self.tasks[self.members[k][order[i]]]

    def _apply(self, report: list[tuple[int, bool]]) -> None:
        for task, signal in report:
            history = self._state["signal"][self._family[task]]
            history.append(signal)
            del history[:-self.window]

    def _metrics(self) -> dict:
        """tasks/share/<family> (its draw probability now) and tasks/signal/<family> (the
        fraction of its last groups, at most `window`, with a signal; absent before it has
        one)."""
        out = {f"tasks/share/{f}": float(p) for f, p in zip(self.families, self.shares())}
        out.update({f"tasks/signal/{f}": float(np.mean(h))
                    for f, h in zip(self.families, self._state["signal"]) if h})
        return out

    def _check_state(self, state: dict) -> None:
        if len(state["taken"]) != len(self.families):
            raise ValueError(f"task mix state: {len(state['taken'])} families, not "
                             f"{len(self.families)} (another task set?)")
