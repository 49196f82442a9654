"""Test-based rewards: what the RL trainer calls to score completions.

    scorer = Scorer(RewardConfig(kind="fraction", hack_penalty=1.0))
    rewards = scorer.score_batch(tasks, completions)      # blocking, ordered
    reward = await scorer.score(task, completion)          # asyncio
    future = scorer.submit(task, completion)               # concurrent.futures
    reward.reward, reward.status, reward.breakdown

Only the sandbox's verdict counts (see docs/sandbox.md); `hack` scores
`-hack_penalty` whatever the tests said.
"""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from rollouts.sandbox import Limits, RunResult, Sandbox, Status
from rollouts.sandbox.lint import DEFAULT_RULES, lint_issues
from rollouts.tasks.task import Task


@dataclass(frozen=True)
class RewardConfig:
    """The `rewards` config section. `all_pass`: 1 if every test passed else 0; `fraction`:
    share of tests passed.

    `hack_penalty` >= 0 is subtracted on `hack` (and is what an agent episode that edited the
    tests earns, negated); `lint_penalty` > 0 runs ruff (`lint_rules`) in the sandbox and
    subtracts the penalty when it finds issues.
    """

    kind: Literal["all_pass", "fraction"] = "all_pass"
    hack_penalty: float = 0.0
    lint_penalty: float = 0.0
    lint_rules: tuple[str, ...] = DEFAULT_RULES
    # The sandbox a run's Scorer uses (jaxagent.train.build.make_scorer passes them on; a
    # Scorer made directly takes them as arguments).
    backend: Literal["bwrap", "docker", "process"] = "bwrap"
    workers: int = 2

    def __post_init__(self) -> None:
        if self.kind not in ("all_pass", "fraction"):
            raise ValueError(
                f"RewardConfig.kind must be 'all_pass' or 'fraction', got {self.kind!r}"
            )
        if self.hack_penalty < 0 or self.lint_penalty < 0:
            raise ValueError(
                "RewardConfig penalties must be >= 0 (they are subtracted)"
            )


@dataclass(frozen=True)
class Reward:
    """A scored completion: `reward` is the sum of `breakdown`'s terms."""

    task_id: str
    reward: float
    status: Status
    breakdown: dict[str, float]
    result: RunResult
    lint: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        return self.result.passed


def combine(
    task_id: str, result: RunResult, config: RewardConfig, lint: Sequence[str] = ()
) -> Reward:
    """The reward for one sandbox result (pure: no I/O)."""
    graded = result.status in ("passed", "failed")
    tests = (
        float(result.passed)
        if config.kind == "all_pass"
        else (result.fraction_passed if graded else 0.0)
    )
    breakdown = {
        "tests": tests,
        "hack": -float(config.hack_penalty) if result.status == "hack" else 0.0,
        "lint": -float(config.lint_penalty) if lint else 0.0,
    }
    return Reward(
        task_id, sum(breakdown.values()), result.status, breakdown, result, tuple(lint)
    )


_REPEATABLE = ("passed", "failed")  # verdicts a rerun of the same program gives again


class Scorer:
    """Scores (task, completion) pairs in a `Sandbox`; owns it unless one is given.

    Identical runs (the same task and program: a GRPO group often samples the same completion
    several times) share one sandbox run: the last `cache_size` passed/failed verdicts are kept
    by the run request's digest. Timeouts, OOMs, hacks and errors are never reused.
    """

    def __init__(
        self,
        config: RewardConfig | None = None,
        sandbox: Sandbox | None = None,
        backend: str = "bwrap",
        workers: int | None = None,
        limits: Limits | None = None,
        cache_size: int = 4096,
    ):
        self.config = config or RewardConfig()
        self.cache_size = cache_size
        self.cache_hits = 0
        self._verdicts: OrderedDict[bytes, Future[Reward]] = OrderedDict()
        self._verdicts_lock = threading.Lock()
        self._owned = sandbox is None
        self.sandbox = sandbox or Sandbox(backend, workers=workers, limits=limits)
        self._lint_pool = (
            ThreadPoolExecutor(self.sandbox.workers)
            if self.config.lint_penalty
            else None
        )

    def submit(self, task: Task, completion: str) -> Future[Reward]:
        try:
            request = task.request(completion)
        except ValueError as e:
            # e.g. a repository edit that is not JSON: a failed attempt, not a crash
            failed: Future[Reward] = Future()
            failed.set_result(
                combine(
                    task.id,
                    RunResult("failed", 0, len(task.tests), str(e)),
                    self.config,
                )
            )
            return failed
        key = hashlib.sha256(pickle.dumps((task.id, request))).digest()
        with self._verdicts_lock:
            shared = self._verdicts.get(key)
            if shared is not None:
                self._verdicts.move_to_end(key)
                self.cache_hits += 1
                return shared
        out = self._run(task, request, completion)
        if self.cache_size > 0:
            with self._verdicts_lock:
                self._verdicts[key] = out
                while len(self._verdicts) > self.cache_size:
                    self._verdicts.popitem(last=False)

            def forget_unless_repeatable(f: Future[Reward]) -> None:
                if f.exception() is None and f.result().status in _REPEATABLE:
                    return
                with self._verdicts_lock:
                    if self._verdicts.get(key) is f:
                        del self._verdicts[key]

            out.add_done_callback(forget_unless_repeatable)
        return out

    def _run(self, task: Task, request, completion: str) -> Future[Reward]:
        run = self.sandbox.submit(request)
        lint = None
        if self._lint_pool and task.repo is None:  # repository edits are JSON, not code
            lint = self._lint_pool.submit(self._lint, task.program(completion))
        out: Future[Reward] = Future()

        def finish(_: Future) -> None:
            if lint is not None and not lint.done():
                lint.add_done_callback(finish)
                return
            try:
                out.set_result(
                    combine(
                        task.id,
                        run.result(),
                        self.config,
                        lint.result() if lint else (),
                    )
                )
            except Exception as e:
                out.set_exception(e)

        run.add_done_callback(finish)
        return out

    def _lint(self, program: str) -> list[str]:
        return lint_issues(self.sandbox.launcher, program, self.config.lint_rules)

    async def score(self, task: Task, completion: str) -> Reward:
        return await asyncio.wrap_future(self.submit(task, completion))

    def score_batch(
        self, tasks: Sequence[Task], completions: Sequence[str]
    ) -> list[Reward]:
        if len(tasks) != len(completions):
            raise ValueError(f"{len(tasks)} tasks but {len(completions)} completions")
        futures = [self.submit(t, c) for t, c in zip(tasks, completions)]
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._lint_pool:
            self._lint_pool.shutdown()
        if self._owned:
            self.sandbox.close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
