"""The `process` backend: same harness and verdicts, no isolation, opt-in with a warning."""

from __future__ import annotations

import pytest

from rollouts.sandbox import Limits, Sandbox


@pytest.fixture(scope="module")
def process_sandbox():
    with pytest.warns(UserWarning, match="WITHOUT isolation"):
        sb = Sandbox("process", workers=1, limits=Limits(wall_s=2, cpu_s=2))
    with sb:
        yield sb


def test_verdicts_match_the_isolated_backend(process_sandbox, humaneval, leftovers):
    task = humaneval["HumanEval/0"]
    completions = {
        "passed": task.metadata["reference"],
        "failed": "    return None\n",
        "hack": "    import os\n    os._exit(0)\n",
        "timeout": "    while True:\n        pass\n",
    }
    for status, completion in completions.items():
        assert (
            process_sandbox.submit(task.request(completion)).result().status == status
        )
    assert leftovers() == []


def test_descendants_are_killed_after_the_run(process_sandbox, humaneval, leftovers):
    daemon = "    import os, time\n    if os.fork() == 0:\n        os.setsid()\n        time.sleep(1000)\n    return None\n"
    assert (
        process_sandbox.submit(humaneval["HumanEval/2"].request(daemon)).result().status
        == "failed"
    )
    assert leftovers() == []
