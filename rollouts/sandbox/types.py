"""Request and result records shared by every backend."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from rollouts.sandbox.guest.wire import encode_files

Status = Literal["passed", "failed", "error", "timeout", "oom", "hack"]
STATUSES: tuple[str, ...] = ("passed", "failed", "error", "timeout", "oom", "hack")
SKIP_KINDS = ("skipped", "xfailed")  # how a test the original run did not pass ended


def check_skips(skips: object, field: str) -> None:
    """ValueError naming `field` unless `skips` is None or maps test ids to SKIP_KINDS."""
    if skips is not None and not (isinstance(skips, dict) and all(
            isinstance(n, str) and k in SKIP_KINDS for n, k in skips.items())):
        raise ValueError(f"{field} must map test ids to one of {SKIP_KINDS}, got {skips!r:.200}")


@dataclass(frozen=True)
class Limits:
    """Per-run resource limits, enforced with rlimits and (where writable) cgroups."""

    wall_s: float = 10.0
    cpu_s: float = 10.0
    memory_mb: int = 512
    max_procs: int = 32
    file_size_mb: int = 16
    output_bytes: int = 1 << 20  # beyond it output is discarded and flagged, never judged
    tmpfs_mb: int = 64

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(
                    f"Limits.{f.name} must be positive, got {getattr(self, f.name)!r}"
                )


@dataclass(frozen=True)
class TestCase:
    """One graded unit: trusted Python run in the grader, calling `candidate(...)`."""

    __test__ = False  # not a pytest class
    name: str
    code: str


@dataclass(frozen=True)
class RunRequest:
    """What to run: the solution program and the trusted tests that grade it.

    mode "call": `setup` is trusted code (task helpers, test module top level)
    executed in the grader before the `cases`; `files` are written into the
    work dir first. mode "pytest" (repository tasks): `files` is the pristine
    repository, `edits` the solution's files, `protected` the test paths the
    solution may not touch, `pytest_args` the test command's arguments, `skips` the
    tests (or modules) that skipped or failed as expected in the original run, node id ->
    "skipped" or "xfailed": only they may end so again (None: every test must pass).
    """

    program: str
    entry_point: str
    cases: tuple[TestCase, ...]
    setup: str = ""
    files: dict[str, str | bytes] = field(default_factory=dict)  # bytes: a binary file
    image: str | None = None  # docker backend: the task's image
    mode: Literal["call", "pytest"] = "call"
    edits: dict[str, str | bytes] = field(default_factory=dict)
    protected: tuple[str, ...] = ()
    pytest_args: tuple[str, ...] = ()
    # pytest mode: "isolated" runs pytest and the pristine tests in the grader, the
    # solution's modules as proxies (nothing it runs can touch the verdict); "in-process"
    # runs pytest in the solution's process, for APIs that cannot cross as plain data.
    grading: Literal["isolated", "in-process"] = "isolated"
    skips: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.grading not in ("isolated", "in-process"):
            raise ValueError(f"RunRequest.grading must be 'isolated' or 'in-process', got {self.grading!r}")
        check_skips(self.skips, "RunRequest.skips")

    def spec(self, limits: Limits) -> dict:
        """What the solution may see (it is in the memory the solution forks from)."""
        return {
            "program": self.program,
            "entry_point": self.entry_point,
            "files": encode_files(self.files),
            "limits": dataclasses.asdict(limits),
            "mode": self.mode,
            "edits": encode_files(self.edits),
            "protected": list(self.protected),
            "pytest_args": list(self.pytest_args),
            "grading": self.grading,
            "skips": self.skips,
        }

    def secret(self, nonce: str) -> dict:
        """What only the grader may see: the tests (expected values!) and the nonce."""
        return {
            "nonce": nonce,
            "setup": self.setup,
            "cases": [{"name": c.name, "code": c.code} for c in self.cases],
        }


@dataclass(frozen=True)
class RunResult:
    """The verdict of one run. `passed` only when the harness saw every case pass."""

    status: Status
    tests_passed: int
    tests_total: int
    message: str = ""
    output: str = ""
    output_bytes: int = 0
    output_truncated: bool = False  # the solution wrote more than Limits.output_bytes
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def fraction_passed(self) -> float:
        return self.tests_passed / self.tests_total if self.tests_total else 0.0
