"""`jaxagent check-solutions` and `jaxagent tasks`."""

from __future__ import annotations

import json

import pytest

from jaxagent.cli import main


@pytest.fixture(scope="module")
def humaneval():
    from rollouts.tasks import humaneval_tasks

    return {t.id: t for t in humaneval_tasks()}


def _solutions(tmp_path, humaneval, extra_lines=()):
    lines = [
        json.dumps(
            {
                "task_id": "HumanEval/0",
                "completion": humaneval["HumanEval/0"].metadata["reference"],
            }
        ),
        json.dumps({"task_id": "HumanEval/2", "completion": "    return 0.0\n"}),
        *extra_lines,
        json.dumps(
            {
                "task_id": "HumanEval/4",
                "completion": "    import sys\n    sys.exit(0)\n",
            }
        ),
    ]
    path = tmp_path / "solutions.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(tmp_path, solutions, *extra):
    out = tmp_path / "results.jsonl"
    rc = main(
        [
            "check-solutions",
            "--tasks",
            "humaneval",
            "--solutions",
            str(solutions),
            "--out",
            str(out),
            *extra,
        ]
    )
    return rc, [json.loads(line) for line in out.read_text().splitlines()]


def test_results_in_input_order_with_required_fields(tmp_path, humaneval):
    rc, records = _run(tmp_path, _solutions(tmp_path, humaneval), "--workers", "2")
    assert rc == 0
    assert [(r["task_id"], r["status"], r["passed"], r["reward"]) for r in records] == [
        ("HumanEval/0", "passed", True, 1.0),
        ("HumanEval/2", "failed", False, 0.0),
        ("HumanEval/4", "hack", False, 0.0),
    ]
    assert records[1]["message"].startswith(
        "HumanEval/2#0: assert candidate(3.5) == 0.5"
    )
    assert all("seconds" in r and "tests_total" in r for r in records)


def test_bad_lines_become_errors_and_nothing_is_lost(tmp_path, humaneval, capsys):
    bad = [
        "{broken",
        json.dumps({"completion": "x"}),
        json.dumps({"task_id": "Nope/1", "completion": "x"}),
    ]
    rc, records = _run(tmp_path, _solutions(tmp_path, humaneval, bad))
    assert rc == 1
    assert [r["status"] for r in records] == [
        "passed",
        "failed",
        "error",
        "error",
        "error",
        "hack",
    ]
    messages = [r["message"] for r in records[2:5]]
    assert ":3: invalid JSON" in messages[0]
    assert ":4: field 'task_id': missing" in messages[1]
    assert ":5: field 'task_id': unknown task 'Nope/1'" in messages[2]
    assert "solutions.jsonl:3: invalid JSON" in capsys.readouterr().err


def test_unknown_backend_task_set_or_file_are_clear_errors(tmp_path, humaneval, capsys):
    with pytest.raises(SystemExit):
        _run(tmp_path, _solutions(tmp_path, humaneval), "--backend", "qemu")
    assert "invalid choice: 'qemu'" in capsys.readouterr().err
    assert main(["tasks", "list", "--tasks", "nosuch"]) == 2
    assert "error: unknown task set 'nosuch'" in capsys.readouterr().err
    missing = str(tmp_path / "missing.jsonl")
    out = str(tmp_path / "out.jsonl")
    args = [
        "check-solutions",
        "--tasks",
        "synthetic:2",
        "--solutions",
        missing,
        "--out",
        out,
    ]
    assert main(args) == 2
    assert (
        f"error: [Errno 2] No such file or directory: '{missing}'"
        in capsys.readouterr().err
    )
    bad_tasks = tmp_path / "tasks.jsonl"
    bad_tasks.write_text('{"task_id": 1}\n')
    assert main(["tasks", "list", "--tasks", str(bad_tasks)]) == 2
    assert "tasks.jsonl:1: field 'prompt': missing" in capsys.readouterr().err


def test_tasks_list_and_show(capsys):
    assert main(["tasks", "list", "--tasks", "synthetic:3:7"]) == 0
    assert (
        capsys.readouterr().out.splitlines()[0].startswith("synthetic/7/0\tf\t4 tests")
    )
    assert main(["tasks", "show", "HumanEval/2"]) == 0
    shown = capsys.readouterr().out
    assert "def truncate_number" in shown and "# HumanEval/2#0" in shown
    assert main(["tasks", "show", "HumanEval/999"]) == 1


def test_check_solutions_never_destroys_input(tmp_path, humaneval, capsys):
    solutions = _solutions(tmp_path, humaneval)
    before = solutions.read_bytes()
    args = ["check-solutions", "--tasks", "humaneval", "--solutions", str(solutions)]
    # --out naming the input (also through a link) is refused before anything is opened.
    link = tmp_path / "link.jsonl"
    link.symlink_to(solutions)
    for out in (solutions, link):
        assert main([*args, "--out", str(out)]) == 2
        assert "is the --solutions file" in capsys.readouterr().err
        assert solutions.read_bytes() == before
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task_id": "t", "prompt": "p", "entry_point": "f",
                                 "tests": ["assert f() == 1"]}) + "\n")
    assert main(["check-solutions", "--tasks", str(tasks), "--solutions", str(solutions),
                 "--out", str(tasks)]) == 2
    assert "is the --tasks file" in capsys.readouterr().err and tasks.stat().st_size > 0
    # A typo in --solutions leaves an existing --out as it was.
    out = tmp_path / "results.jsonl"
    out.write_text("earlier results\n")
    assert main(["check-solutions", "--tasks", "humaneval", "--solutions",
                 str(tmp_path / "typo.jsonl"), "--out", str(out)]) == 2
    assert out.read_text() == "earlier results\n"
    assert "typo.jsonl" in capsys.readouterr().err


def test_non_utf8_costs_its_line_only(tmp_path, humaneval, capsys):
    solutions = _solutions(tmp_path, humaneval)
    with solutions.open("ab") as f:
        f.write(b'{"task_id": "HumanEval/0", "completion": "\xff\xfe"}\n')
    rc, records = _run(tmp_path, solutions)
    assert rc == 1 and [r["status"] for r in records] == ["passed", "failed", "hack", "error"]
    assert records[3]["message"].endswith("solutions.jsonl:4: not UTF-8 (byte 43)")
    assert not (tmp_path / "results.jsonl.partial").exists()  # renamed when complete


def test_check_solutions_timeout_must_be_positive(tmp_path, humaneval, capsys):
    assert main(["check-solutions", "--tasks", "humaneval", "--solutions",
                 str(_solutions(tmp_path, humaneval)), "--out", str(tmp_path / "o.jsonl"),
                 "--timeout", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--timeout: must be > 0" in err and "Limits" not in err
    assert not (tmp_path / "o.jsonl").exists()


def test_tasks_check_reports_bad_references_and_passes_good_sets(tmp_path, capsys):
    good = {"task_id": "ok", "prompt": "def f(x):\n", "entry_point": "f",
            "tests": ["assert f(2) == 4"], "reference": "def f(x):\n    return 2 * x\n"}
    wrong = {**good, "task_id": "wrong", "reference": "def f(x):\n    return x\n"}
    bare = {k: v for k, v in {**good, "task_id": "bare"}.items() if k != "reference"}
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(t) for t in (good, wrong, bare)) + "\n")
    assert main(["tasks", "check", str(tasks)]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "bare: no reference solution to check",
        "wrong: the reference solution does not pass its tests: failed: wrong#0: assert f(2) == 4"
        " -> AssertionError: got 2, compared with 4"]
    assert "3 tasks checked" in err and "2 problems" in err
    shipped = "rollouts/tasks/data/textkit_tasks"
    assert main(["tasks", "check", "--tasks", shipped]) == 0
    assert "every reference passes, no leak" in capsys.readouterr().err


def test_a_test_that_cannot_compile_is_refused_at_load(tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"task_id": "t", "prompt": "p", "entry_point": "f",
                                 "tests": ["assert f(1) == 1", "assert f(2) ==="]}) + "\n")
    assert main(["tasks", "list", "--tasks", str(tasks)]) == 2
    assert "tasks.jsonl:1: field 'tests[1]': syntax error: invalid syntax (line 1)" in capsys.readouterr().err


def test_tasks_stats_sizes_a_task_set(capsys):
    assert main(["tasks", "stats", "rollouts/tasks/data/textkit_tasks"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0] == "task\ttarget_tests\tfunctions\tbody_lines\treference_passes"
    rows = {line.split("\t")[0]: line.split("\t")[1:] for line in lines[1:]}
    assert rows["textkit-median"] == ["1", "1", "5", "True"]  # the 5-line body of median
    assert f"{len(rows)} tasks:" in err and f"references passing {len(rows)}/{len(rows)}" in err
