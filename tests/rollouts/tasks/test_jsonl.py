from __future__ import annotations

import json

import pytest

from rollouts.tasks import TaskFormatError, load_jsonl_tasks

GOOD = {
    "task_id": 11,
    "text": "Write a function that adds one.",
    "entry_point": "add_one",
    "test_list": ["assert add_one(1) == 2", "assert candidate(-1) == 0"],
    "code": "def add_one(x):\n    return x + 1\n",
}


def _write(tmp_path, *records) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n"
    )
    return str(path)


def test_mbpp_style_records_load_and_their_references_pass(tmp_path, bwrap_sandbox):
    (task,) = load_jsonl_tasks(_write(tmp_path, GOOD))
    assert task.id == "11" and task.completion_mode == "full" and len(task.tests) == 2
    result = bwrap_sandbox.submit(task.request(task.metadata["reference"])).result()
    assert result.status == "passed"
    assert (
        bwrap_sandbox.submit(task.request("def add_one(x):\n    return x\n"))
        .result()
        .status
        == "failed"
    )


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ("{not json", r"tasks.jsonl:2: invalid JSON"),
        (
            {**GOOD, "tests": []},
            r"tasks.jsonl:2: field 'tests': expected a non-empty list",
        ),
        (
            {k: v for k, v in GOOD.items() if k != "entry_point"},
            r"tasks.jsonl:2: field 'entry_point': missing",
        ),
        (
            {**GOOD, "entry_point": "not valid"},
            r"field 'entry_point': 'not valid' is not a Python identifier",
        ),
        ({**GOOD, "completion_mode": "half"}, r"field 'completion_mode'"),
        (
            {**GOOD, "tset_setup": ""},
            r"tasks.jsonl:2: field 'tset_setup': unknown field",
        ),
        ({**GOOD, "task_id": 12, "files": {"a": 1}}, r"field 'files'"),
        ([1, 2], r"tasks.jsonl:2: expected a JSON object"),
        (GOOD, r"tasks.jsonl:2: field 'task_id': duplicate '11' \(first on line 1\)"),
    ],
)
def test_errors_name_the_line_and_field(tmp_path, record, message):
    path = _write(tmp_path, GOOD, record)
    with pytest.raises(TaskFormatError, match=message):
        load_jsonl_tasks(path)
