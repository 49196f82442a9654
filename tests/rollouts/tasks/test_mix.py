"""The family mix: families drawn by the share of their recent groups with a signal (the
formula of rollouts.tasks.mix, in float64 here), at least the floor each; tasks within a family
once a pass; draws that depend on the reports behind a batch's version alone, and resume."""

from __future__ import annotations

import numpy as np
import pytest

from rollouts.producer import Rollout, RolloutBatch
from rollouts.tasks import Task
from rollouts.tasks.mix import FamilyMix

FAMILIES = {"alpha": 5, "beta": 3, "gamma": 7}


def tasks() -> list[Task]:
    return [Task(id=f"{f}{i}", prompt=f"{f} {i}", entry_point="f", tests=(),
                 metadata={"family": f}) for f, n in FAMILIES.items() for i in range(n)]


def family(task: Task) -> str:
    return task.metadata["family"]


def test_every_family_starts_equal_and_each_pass_takes_every_task_once():
    mix = FamilyMix(tasks(), window=4, floor=0.05, seed=1)
    np.testing.assert_allclose(mix.shares(), [1 / 3] * 3)
    drawn = [next(mix) for _ in range(300)]
    for f, n in FAMILIES.items():
        ids = [t.id for t in drawn if family(t) == f]
        assert 60 < len(ids) < 140  # ~100 each: binomial(300, 1/3) sd ~8
        passes = [ids[k:k + n] for k in range(0, len(ids) - n + 1, n)]
        assert all(sorted(p) == sorted(passes[0]) for p in passes)  # each task once a pass
        assert len({tuple(p) for p in passes}) > 1  # in a fresh order each pass


def test_shares_follow_each_familys_last_groups_with_a_signal():
    window, floor = 4, 0.07
    mix = FamilyMix(tasks(), window=window, floor=floor, seed=0)
    reports = [[("alpha0", True), ("beta1", False), ("gamma2", True), ("alpha3", False)],
               [("beta0", False), ("alpha1", True), ("alpha2", True), ("alpha4", True)],
               [("gamma5", False), ("beta2", False)]]
    for step, report in enumerate(reports):
        mix.record(step, report)
    metrics = mix.apply(3)
    # the last `window` groups of each family, in batch order (alpha drops its first
    # report), the slots not yet filled counted as signal
    signal = {"alpha": 3 / 4, "beta": (0 + 1) / 4, "gamma": (1 + 2) / 4}
    base = np.asarray(list(signal.values()), np.float64) / sum(signal.values())
    want = floor + (1 - 3 * floor) * base
    np.testing.assert_allclose(mix.shares(), want, rtol=1e-12)
    assert metrics["tasks/share/beta"] == pytest.approx(want[1])
    assert metrics["tasks/signal/alpha"] == 0.75 and metrics["tasks/signal/beta"] == 0.0
    assert metrics["tasks/signal/gamma"] == 0.5  # the groups seen
    counts = {f: 0 for f in FAMILIES}
    for _ in range(2000):
        counts[family(next(mix))] += 1
    for f, p in zip(mix.families, want):
        assert abs(counts[f] / 2000 - p) < 4 * np.sqrt(p * (1 - p) / 2000)


def test_no_family_with_a_signal_draws_evenly_and_a_zero_floor_starves_the_silent():
    mix = FamilyMix(tasks(), window=2, floor=0.0, seed=0)
    mix.record(0, [("alpha0", False), ("beta0", False), ("gamma0", False)])
    mix.apply(1)
    np.testing.assert_allclose(mix.shares(), [1 / 3] * 3)
    mix.record(1, [("alpha1", False), ("beta1", False), ("gamma1", True)])
    mix.apply(2)
    np.testing.assert_allclose(mix.shares(), [0.0, 0.0, 1.0])
    assert {family(next(mix)) for _ in range(50)} == {"gamma"}


def test_a_resumed_mix_draws_what_the_uninterrupted_one_did():
    def run(mix, steps, start=0):
        drawn = []
        for step in range(start, steps):
            mix.apply(step)
            batch = [next(mix) for _ in range(4)]
            drawn.append([t.id for t in batch])
            # a "policy" that has learnt alpha: its groups all pass, the others' differ
            mix.record(step, [(t.id, family(t) != "alpha") for t in batch])
        return drawn

    straight = run(FamilyMix(tasks(), window=3, floor=0.05, seed=2), 12)
    first = FamilyMix(tasks(), window=3, floor=0.05, seed=2)
    head = run(first, 5)
    first.apply(5)
    state = first.get_state()
    second = FamilyMix(tasks(), window=3, floor=0.05, seed=2)
    second.set_state(state)
    assert head + run(second, 12, start=5) == straight
    assert second.metrics()["tasks/share/alpha"] == pytest.approx(0.05)


def test_bad_settings_and_reports_name_what_is_wrong():
    with pytest.raises(ValueError, match="tasks.mix.window: must be >= 1"):
        FamilyMix(tasks(), window=0, floor=0.05)
    with pytest.raises(ValueError, match=r"tasks.mix.floor: must be in \[0, 1/3\]"):
        FamilyMix(tasks(), window=2, floor=0.4)
    bare = [Task(id="x", prompt="", entry_point="f", tests=())]
    with pytest.raises(ValueError, match=r"without metadata\['family'\].*\['x'\]"):
        FamilyMix(bare, window=2, floor=0.0)
    mix = FamilyMix(tasks(), window=2, floor=0.05)
    with pytest.raises(KeyError, match="'nope' is not in the task mix's task list"):
        mix.record(0, [("nope", True)])
    with pytest.raises(RuntimeError, match="task mix: batch 0's outcomes were not recorded"):
        mix.apply(1)
    with pytest.raises(ValueError, match="task mix state: 2 families, not 3"):
        mix.set_state({**mix.get_state(), "taken": [0, 0]})
    with pytest.raises(ValueError, match=r"task mix state: missing \['signal'\]"):
        mix.set_state({"draws": 0, "applied": 0, "taken": [0, 0, 0]})


def test_a_group_has_a_signal_when_its_scored_rewards_differ():
    def rollout(task, reward, status="failed", masked=False):
        return Rollout(task, [1], [2], [True], [0.0], "", reward, status, "stop", 0,
                       masked=masked)

    rows = [rollout("mixed", 1.0, "passed"), rollout("mixed", 0.0),
            rollout("same", 0.5), rollout("same", 0.5),
            rollout("infra", 1.0, "passed"), rollout("infra", 0.0, "infra_error"),
            rollout("cut", 1.0, "passed"), rollout("cut", 0.0, masked=True)]
    batch = RolloutBatch(0, 2, rows, {})
    assert batch.group_signals() == [("mixed", True), ("same", False), ("infra", False),
                                     ("cut", False)]
