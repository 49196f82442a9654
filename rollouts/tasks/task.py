"""The `Task` record every loader produces and every backend grades."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from rollouts.sandbox.types import RunRequest, TestCase

CompletionMode = Literal["continue", "full"]


class TaskFormatError(ValueError):
    """A task set is malformed or unknown; the message names the file, line and field."""


@dataclass(frozen=True)
class Task:
    """One programming task.

    `completion_mode="continue"` (HumanEval): the program is prompt + completion;
    `"full"`: the completion is the whole program. `tests` are trusted snippets
    run by the grader with `candidate` (and the entry point's name) bound to the
    solution. `repo`/`test_command` describe repository tasks (see `repo.py`).
    `metadata["reference"]`, when present, is a completion known to pass;
    `metadata["grading"]` (repository tasks) is "isolated" or "in-process" (see `grading`);
    `metadata["skips"]`, the tests that skipped in the original run (`RunRequest.skips`).
    """

    id: str
    prompt: str
    entry_point: str
    tests: tuple[TestCase, ...]
    test_setup: str = ""
    files: dict[str, str | bytes] = field(default_factory=dict)  # bytes: a binary file
    repo: str | None = None
    test_command: tuple[str, ...] = ()
    language: str = "python"
    completion_mode: CompletionMode = "continue"
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def grading(self) -> str:
        """Where the tests run: "isolated" (in the grader, never beside the solution's code;
        every function-call task) or "in-process" (pytest in the solution's process, for a
        repository whose API cannot cross as plain data; `rollouts.tasks.repo.choose_grading`)."""
        return self.metadata.get("grading", "isolated") if self.repo is not None else "isolated"

    def program(self, completion: str) -> str:
        return (
            self.prompt + completion
            if self.completion_mode == "continue"
            else completion
        )

    def request(self, completion: str, image: str | None = None) -> RunRequest:
        """The sandbox run grading `completion`; ValueError if it cannot be one."""
        if self.language != "python":
            raise ValueError(
                f"task {self.id}: language {self.language!r} is not supported by the sandbox"
            )
        if self.repo is not None:
            return self._repo_request(completion, image)
        return RunRequest(
            program=self.program(completion),
            entry_point=self.entry_point,
            cases=self.tests,
            setup=self.test_setup,
            files=dict(self.files),
            image=image or self.metadata.get("docker_image"),
        )

    def _repo_request(self, completion: str, image: str | None) -> RunRequest:
        """Repository tasks: the completion is a JSON object {path: new file content}."""
        try:
            edits = json.loads(completion)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"task {self.id}: completion is not JSON ({e.msg}); expected {{path: content}}"
            ) from None
        if not isinstance(edits, dict) or not all(
            isinstance(v, str) for v in edits.values()
        ):
            raise ValueError(
                f"task {self.id}: completion must be a JSON object mapping paths to file contents"
            )
        return RunRequest(
            program="",
            entry_point="",
            cases=(),
            files=dict(self.files),
            image=image or self.metadata.get("docker_image"),
            mode="pytest",
            edits=edits,
            protected=tuple(self.metadata.get("test_paths", ())),
            pytest_args=pytest_args(self.test_command),
            grading=self.grading,
            skips=self.metadata.get("skips"),
        )


def pytest_args(command: tuple[str, ...]) -> tuple[str, ...]:
    """The arguments of a `pytest ...` or `python -m pytest ...` test command."""
    if command[:1] == ("pytest",):
        return command[1:]
    if (
        len(command) >= 3
        and command[0] in ("python", "python3")
        and command[1:3] == ("-m", "pytest")
    ):
        return command[3:]
    raise ValueError(
        f"test command {' '.join(command)!r} is not `pytest ...` or `python -m pytest ...`"
    )
