"""The embedded agent task family: deterministic, varied, split once; every template's tasks
fail as given, pass with their reference, fail with a blind edit from the prompt, and hold no
copy of their answer."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest

from rollouts.rewards import Scorer
from rollouts.tasks.agent_family import (
    _FEW,
    DEFAULT_TEMPLATES,
    FACT_IN_TEST_OUTPUT,
    TEMPLATES,
    agent_family_tasks,
    agent_task_splits,
    answer_leaks,
    parse_spec,
    redraw,
    validation_tasks,
)


def test_generation_is_deterministic_and_varied():
    a, b = agent_family_tasks(40, seed=3), agent_family_tasks(40, seed=3)
    assert [(t.prompt, t.files, t.metadata) for t in a] == [(t.prompt, t.files, t.metadata) for t in b]
    assert {t.metadata["family"] for t in a} == set(DEFAULT_TEMPLATES) < set(TEMPLATES)
    assert len({t.metadata["split_key"] for t in a}) == 40  # names and constants vary
    assert agent_family_tasks(4, seed=4)[0].files != a[0].files
    with pytest.raises(ValueError, match="unknown agent task templates"):
        agent_family_tasks(1, templates=["nope"])


def test_fixed_names_keep_every_other_draw():
    made_up, fixed = agent_family_tasks(10, seed=2), agent_family_tasks(10, seed=2, names="fixed")
    for a, b in zip(made_up, fixed):
        pkg = next(iter(a.files)).split("/")[0]  # the package's __init__.py comes first
        mod = next(p for p in a.files if p.startswith("tests/"))[len("tests/test_"):-3]
        assert all(p.startswith(("app/", "tests/")) for p in b.files), b.files
        # only the names differ: renaming the package and module gives the fixed task
        def rename(text):
            for old, new in ((pkg, "app"), (mod, "core"), (mod.capitalize(), "Core")):
                text = text.replace(old, new)
            return text

        assert rename(a.prompt) == b.prompt
        assert {rename(p): rename(c) for p, c in a.files.items()} == b.files
        assert rename(a.metadata["reference"]) == b.metadata["reference"]
    with pytest.raises(ValueError, match="unknown agent task names"):
        agent_family_tasks(1, names="nope")


def test_split_is_fixed_and_held_out_tasks_are_never_trained_on():
    train, held = agent_task_splits(400, 20, seed=0)
    assert len(held) == 20 and 250 < len(train) < 400  # about a fifth held out
    keys = {t.metadata["split_key"] for t in train}
    assert not keys & {t.metadata["split_key"] for t in held}
    # a larger train set only adds tasks (the split of a task never changes)
    bigger, _ = agent_task_splits(800, 20, seed=0)
    assert keys <= {t.metadata["split_key"] for t in bigger}
    assert {t.id for t in held}.isdisjoint(t.id for t in train)
    # validation tasks: held out too, and none of the tasks a run is evaluated on
    valid = validation_tasks(30, 20, seed=0)
    assert len(valid) == 30 and not {t.metadata["split_key"] for t in valid} & keys
    assert {t.id for t in valid}.isdisjoint(t.id for t in held)
    assert validation_tasks(10, 0, seed=0) == held[:10]


def test_spec():
    assert parse_spec("embedded:64") == (64, 0) and parse_spec("embedded:8:5") == (8, 5)
    assert parse_spec("rollouts/tasks/data/textkit_tasks") is None
    for bad in ("embedded:", "embedded:x", "embedded:0", "embedded:1:2:3"):
        with pytest.raises(ValueError, match="embedded:N"):
            parse_spec(bad)


def test_no_task_holds_its_answer_and_contexts_stay_short():
    tasks = agent_family_tasks(210, seed=1, templates=list(TEMPLATES))  # the variants too
    assert [(t.id, answer_leaks(t)) for t in tasks if answer_leaks(t)] == []
    for t in tasks:  # the tiny byte-level model must hold prompt + files
        assert len(t.prompt) + sum(len(c) for c in t.files.values()) < 1500, t.id
    # the check finds a changed line of the reference planted in the prompt
    t = tasks[0]
    (path, content), = json.loads(t.metadata["reference"]).items()
    changed = next(line for line in content.splitlines() if line not in t.files[path].splitlines())
    planted = dataclasses.replace(t, prompt=t.prompt + changed)
    assert answer_leaks(planted)


def test_few_valued_templates_draw_their_value_from_eight_and_the_wrong_one_from_the_rest():
    """`constant_few` / `edge_case_few`: the value (and every redraw of it) is one of the
    template's eight, the constant's wrong value never is, so the file holds no candidate; the
    value shows in the test only."""
    tasks = agent_family_tasks(150, seed=1, templates=["constant_few", "edge_case_few",
                                                       "constant_keyed"])
    seen, rng = set(), random.Random(2)
    for t in tasks:
        family = t.metadata["family"].removesuffix("_few").removesuffix("_keyed")
        facts = json.loads(t.metadata["facts"])
        key = "value" if family == "constant" else "default"
        assert facts[key] in _FEW[family], t.id
        if family == "constant":
            assert facts["wrong"] not in _FEW[family] and 10 <= facts["wrong"] <= 99
        (path, _), = json.loads(t.metadata["reference"]).items()
        test = next(c for p, c in t.files.items() if p.startswith("tests/"))
        value = re.compile(rf"(?<![\d-]){facts[key]}(?!\d)")
        assert value.search(test) and not value.search(t.files[path]) and answer_leaks(t) == []
        seen.add(facts[key])
        mapping = redraw(t, rng)
        if mapping:  # the redrawn value is one of the eight too
            assert int(mapping[str(facts[key])]) in _FEW[family]
    assert len(seen) == 16  # all eight of each drawn
    for values in _FEW.values():  # the first digit names the value
        assert len({str(abs(v))[0] for v in values}) == len(values)


def test_keyed_templates_name_the_fact_as_the_edit_writes_it_and_only_there():
    """`constant_keyed` / `hidden_file_keyed`: the failing assertion's message says
    `NAME should be VALUE`, where the reference's changed line is `NAME = VALUE`; the plain
    templates' tests (same draws otherwise) say nothing of the kind."""
    for plain, keyed in (("constant_few", "constant_keyed"), ("hidden_file", "hidden_file_keyed")):
        pairs = zip(agent_family_tasks(30, seed=4, templates=[plain]),
                    agent_family_tasks(30, seed=4, templates=[keyed]))
        for a, b in pairs:
            (path, content), = json.loads(b.metadata["reference"]).items()
            assert json.loads(a.metadata["reference"]) == {path: content}  # same task drawn
            changed, = (line for line in content.splitlines()
                        if line not in b.files[path].splitlines())
            name, value = changed.split(" = ")
            test_path = next(p for p in b.files if p.startswith("tests/"))
            said = f'"{name} should be {value}"'
            assert said in b.files[test_path] and said not in a.files[test_path], b.id
            # the message is the only difference, and no file holds the changed line
            assert b.files[test_path].replace(", " + said, "") == a.files[test_path]
            assert answer_leaks(b) == [], b.id


@pytest.fixture(scope="module")
def scorer():
    with Scorer(workers=2) as s:
        yield s


@pytest.mark.parametrize("names", ["made_up", "fixed"])
def test_every_template_fails_as_given_and_passes_with_its_reference(scorer, names):
    # two of each template
    tasks = agent_family_tasks(2 * len(TEMPLATES), seed=7, templates=list(TEMPLATES), names=names)
    for t in tasks:
        given = scorer.submit(t, "{}").result()
        reference = scorer.submit(t, t.metadata["reference"]).result()
        blind = scorer.submit(t, t.metadata["blind"]).result()
        assert given.status == "failed" and given.reward == 0.0, (t.id, given.status)
        assert reference.status == "passed" and reference.reward == 1.0, (t.id, reference.result.message)
        # an edit made from the prompt alone (a guess at the missing fact) fails
        assert blind.status == "failed", t.id
    assert set(FACT_IN_TEST_OUTPUT) <= set(TEMPLATES)
