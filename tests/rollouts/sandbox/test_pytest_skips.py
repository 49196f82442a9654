"""Repository tasks whose original run skips tests: the task's record of those skips lets
exactly them skip again (or fail as expected again), and nothing a solution does can make any
other test skip, xfail or go unrun and still pass."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rollouts.tasks import load_repo_task

LIB = "NEEDS_NETWORK = ('test_fetch',)\n\n\ndef add(a, b):\n    return a - b\n"
FIXED = {"lib.py": LIB.replace("a - b", "a + b")}
FILES = {
    # a pristine conftest that lets the repository's own code choose what skips
    "tests/conftest.py": "import pytest\nimport lib\n\n\ndef pytest_collection_modifyitems(items):\n"
    "    for item in items:\n        if item.name in lib.NEEDS_NETWORK:\n"
    "            item.add_marker(pytest.mark.skip(reason='needs the network'))\n",
    "tests/test_lib.py": "import pytest\nfrom lib import add\n\n\ndef test_add():\n    assert add(1, 2) == 3\n\n\n"
    "def test_add_zero():\n    assert add(5, 0) == 5\n\n\ndef test_fetch():\n    assert False\n\n\n"
    "@pytest.mark.xfail(reason='known bug')\ndef test_known_bug():\n    assert add(0.1, 0.2) == 0.3\n",
    "tests/test_optional.py": "import pytest\npytest.importorskip('no_such_module')\n\n\n"
    "def test_never():\n    assert False\n",
}
# What the original run did not pass: a skip chosen by the conftest, an expected failure and a
# module skipped as it was collected (what `make-deletion` records in task.json).
SKIPS = {"tests/test_lib.py::test_fetch": "skipped", "tests/test_lib.py::test_known_bug": "xfailed",
         "tests/test_optional.py": "skipped"}
# Each makes test_add (which the broken `add` fails) skip, fail as expected or not run
# (the other tests pass)...
ATTACKS = {
    "conftest_lever": LIB.replace("('test_fetch',)", "('test_fetch', 'test_add')"),
    "skip_when_called": "import pytest\n" + LIB.replace("    return", "    if (a, b) == (1, 2):\n"
                                                       "        pytest.skip('later')\n    return"),
    "xfail_when_called": "import pytest\n" + LIB.replace("    return", "    if (a, b) == (1, 2):\n"
                                                        "        pytest.xfail('later')\n    return"),
    "skip_the_module": "import pytest\nif __name__ == 'lib':\n    pytest.skip('no', allow_module_level=True)\n" + LIB,
    # in-process, code at import reaches pytest: every failure an expected one, ...
    "xfail_everything": "import _pytest.skipping as s\ns.evaluate_xfail_marks = lambda item: "
    "s.Xfail('x', True, False, None)\n" + LIB,
    # ... a skip chosen by pytest's own skip marks, ...
    "skip_by_mark": "import _pytest.skipping as s\ns.evaluate_skip_marks = lambda item, "
    "marks=s.evaluate_skip_marks: s.Skip('x') if item.name == 'test_add' else marks(item)\n" + LIB,
    # ... collection only (`--co`): every test collected, none run
    "collect_only": "import gc\nfor o in gc.get_objects():\n    if type(o).__name__ == 'Config':\n"
    "        o.option.collectonly = True\n" + LIB,
}


@pytest.fixture(scope="module")
def skipping_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("skipping")
    for path, text in {"lib.py": LIB, **FILES}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    task = load_repo_task(root, ["python", "-m", "pytest", "tests"], task_id="skipping")
    return dataclasses.replace(task, metadata={**task.metadata, "skips": SKIPS})


def _grade(sandbox, task, edits, grading, skips=SKIPS):
    request = dataclasses.replace(task.request(json.dumps(edits)), grading=grading, skips=skips)
    return sandbox.submit(request).result()


@pytest.mark.parametrize("grading", ["isolated", "in-process"])
def test_the_recorded_skips_are_accepted_and_nothing_else(sandboxes_docker_slow, skipping_task, grading):
    fixed = _grade(sandboxes_docker_slow, skipping_task, FIXED, grading)
    assert (fixed.status, fixed.tests_passed, fixed.tests_total) == ("passed", 2, 2), fixed
    broken = _grade(sandboxes_docker_slow, skipping_task, {}, grading)
    assert (broken.status, broken.tests_passed, broken.tests_total) == ("failed", 1, 2), broken
    assert broken.message.startswith("tests/test_lib.py::test_add (call) failed"), broken
    # without the record (a task made before it) every test must pass, as before
    unrecorded = _grade(sandboxes_docker_slow, skipping_task, FIXED, grading, skips=None)
    assert unrecorded.status == "hack" and "test_never was not run" in unrecorded.message, unrecorded
    # a record that is not what happened: the skip of a recorded test fails like any other
    fetch = {"tests/test_lib.py::test_fetch": "xfailed"}
    wrong = _grade(sandboxes_docker_slow, skipping_task, FIXED, grading,
                   skips={**SKIPS, **fetch})
    assert wrong.status == "failed" and "test_fetch (setup) skipped" in wrong.message, wrong


@pytest.mark.parametrize("grading", ["isolated", "in-process"])
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_no_new_skip_earns_a_pass(sandboxes_docker_slow, skipping_task, name, grading, leftovers):
    result = _grade(sandboxes_docker_slow, skipping_task, {"lib.py": ATTACKS[name]}, grading)
    assert result.status != "passed" and result.tests_passed < 2, (name, grading, result)
    assert leftovers() == []


def test_edits_that_configure_pytest_stay_a_hack_with_a_record(sandboxes_docker_slow, skipping_task):
    for edits in ({**FIXED, "conftest.py": "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
                   "    for item in items:\n        item.add_marker(pytest.mark.skip)\n"},
                  {**FIXED, "pytest.ini": "[pytest]\naddopts = --co\n"},
                  {**FIXED, "tests/test_lib.py": "def test_add():\n    pass\n"}):
        result = _grade(sandboxes_docker_slow, skipping_task, edits, "isolated")
        assert result.status == "hack", (edits, result)
