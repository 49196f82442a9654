from __future__ import annotations

import pytest

from rollouts.tasks import synthetic_tasks
from rollouts.tasks.synthetic import FAMILIES


def test_deterministic_per_seed():
    assert synthetic_tasks(30, seed=5) == synthetic_tasks(30, seed=5)
    assert synthetic_tasks(30, seed=5) != synthetic_tasks(30, seed=6)


def test_short_enough_for_a_tiny_byte_level_model():
    for task in synthetic_tasks(200, seed=0):
        assert len(task.prompt) < 64 and len(task.metadata["reference"]) <= 12


def test_every_family_appears_and_references_pass_while_wrong_answers_fail(
    bwrap_sandbox,
):
    tasks = synthetic_tasks(60, seed=1)
    assert {t.metadata["family"] for t in tasks} == set(FAMILIES)
    refs = bwrap_sandbox.map([t.request(t.metadata["reference"]) for t in tasks])
    assert [r.status for r in refs] == ["passed"] * len(tasks)
    wrong = bwrap_sandbox.map(
        [t.request("0\n" if t.prompt.startswith("def f(x)") else "''\n") for t in tasks]
    )
    assert all(r.status == "failed" for r in wrong)


def test_family_filter_and_bad_arguments():
    assert {t.metadata["family"] for t in synthetic_tasks(20, 0, families=["add"])} == {
        "add"
    }
    with pytest.raises(ValueError, match="unknown synthetic families"):
        synthetic_tasks(1, 0, families=["nope"])
    with pytest.raises(ValueError, match="n must be >= 0"):
        synthetic_tasks(-1, 0)


def test_no_task_is_solved_by_a_constant():
    for task in synthetic_tasks(500, seed=2):
        expected = {case.code.rsplit("==", 1)[1] for case in task.tests}
        assert len(expected) >= 2, task
