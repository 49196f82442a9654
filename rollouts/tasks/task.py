"""The `Task` record every loader produces and every backend grades."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rollouts.sandbox.types import RunRequest, TestCase

CompletionMode = Literal["continue", "full"]


class TaskFormatError(ValueError):
    """A task file is malformed; the message names the file, line and field."""


@dataclass(frozen=True)
class Task:
    """One programming task.

    `completion_mode="continue"` (HumanEval): the program is prompt + completion;
    `"full"`: the completion is the whole program. `tests` are trusted snippets
    run by the grader with `candidate` (and the entry point's name) bound to the
    solution. `repo`/`test_command` describe repository tasks (see `repo.py`).
    `metadata["reference"]`, when present, is a completion known to pass.
    """

    id: str
    prompt: str
    entry_point: str
    tests: tuple[TestCase, ...]
    test_setup: str = ""
    files: dict[str, str] = field(default_factory=dict)
    repo: str | None = None
    test_command: tuple[str, ...] = ()
    language: str = "python"
    completion_mode: CompletionMode = "continue"
    metadata: dict[str, Any] = field(default_factory=dict)

    def program(self, completion: str) -> str:
        return (
            self.prompt + completion
            if self.completion_mode == "continue"
            else completion
        )

    def request(self, completion: str, image: str | None = None) -> RunRequest:
        if self.language != "python":
            raise ValueError(
                f"task {self.id}: language {self.language!r} is not supported by the sandbox"
            )
        if self.repo is not None:
            raise ValueError(
                f"task {self.id}: repository tasks are graded by their test command, not run here"
            )
        return RunRequest(
            program=self.program(completion),
            entry_point=self.entry_point,
            cases=self.tests,
            setup=self.test_setup,
            files=dict(self.files),
            image=image or self.metadata.get("docker_image"),
        )
