"""`ToolEnvironment`: a multi-turn tool-using episode over a repository task.

reset: a sandbox session holding the task's repository (and its git history; the last
episode's sandbox, renewed, where there was one), and the prompt
(task + tool schemas, in the chosen call format) as tokens. step: the policy's tokens are
parsed as one tool call, the tool runs in the session, and its output is rendered as a tool
message, tokenized once and returned to be appended. Malformed or unknown calls become an
error observation and are counted. The episode ends on `finish` or a budget (turns, context
tokens, episode wall time); then the repository is graded in a fresh sandbox from the pristine
task with the agent's edits applied, except edits to the tests, which are discarded and flagged
(reward `-hack_penalty` of the scorer's `RewardConfig`, `hack` set).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollouts.agent.config import AgentConfig
from rollouts.agent.formats import BadCall, make_format, observation_text
from rollouts.agent.monitor import lookup_flags
from rollouts.environment import Environment, StepResult
from rollouts.rewards import Scorer
from rollouts.sandbox import Limits
from rollouts.sandbox.launchers import DOCKER_IMAGE
from rollouts.sandbox.lint import ruff_binary
from rollouts.sandbox.run_cache import RunCache
from rollouts.sandbox.session import Session
from rollouts.tasks.task import Task
from rollouts.tools import (
    TOOLS,
    Embedding,
    MemoryStore,
    NgramEmbedding,
    Tool,
    Toolbox,
    ToolContext,
)


def _under(path: str, roots: Sequence[str]) -> bool:
    return any(path == r.rstrip("/") or path.startswith(r.rstrip("/") + "/") for r in roots)


def edited_test_files(pristine: dict[str, str | bytes], final: dict[str, str],
                      test_paths: Sequence[str]) -> list[str]:
    """Test files the agent added, changed or removed (text: `final` holds no binary file, and
    the grader writes the pristine binary ones itself)."""
    paths = {p for p in (*pristine, *final)
             if _under(p, test_paths) and not isinstance(pristine.get(p), bytes)}
    return sorted(p for p in paths if pristine.get(p) != final.get(p))


class ToolEnvironment(Environment):
    """One episode at a time over repository tasks; `scorer` grades (bwrap by default)."""

    def __init__(
        self,
        tokenizer,
        options: AgentConfig | None = None,
        scorer: Scorer | None = None,
        memory: MemoryStore | None = None,
        embedding: Embedding | None = None,
        tools: Sequence[Tool] = TOOLS,
        backend: str = "bwrap",
        limits: Limits | None = None,
        run_cache: RunCache | None = None,
    ):
        self.tokenizer = tokenizer
        self.options = options or AgentConfig()
        self.format = make_format(self.options.call_format)
        self.toolbox = Toolbox(tools)
        self.scorer = scorer
        self._owns_scorer = scorer is None
        self.memory, self.embedding = memory, embedding or NgramEmbedding()
        self.backend = backend
        self.limits = limits or Limits(wall_s=self.options.tool_timeout_s,
                                       cpu_s=self.options.tool_timeout_s)
        self.run_cache = run_cache  # `run_tests` runs shared with other environments
        self.session: Session | None = None  # the episode's; None between episodes
        self._sandbox: Session | None = None  # kept from one episode to the next (renewed)
        self.task: Task | None = None

    # ---- episode ----
    def reset(self, task: Task) -> list[int]:
        if task.repo is None:
            raise ValueError(f"task {task.id}: ToolEnvironment needs a repository task")
        self.task = task
        git_source, image = task.metadata.get("git_source"), task.metadata.get("docker_image")
        if self._sandbox is not None and self._sandbox.image == (image or DOCKER_IMAGE):
            self._sandbox.renew(task.files, git_source=git_source)  # see Session.renew
        else:
            self._close_sandbox()
            self._sandbox = Session(task.files, backend=self.backend, limits=self.limits,
                                    tools={"ruff": ruff_binary()}, git_source=git_source,
                                    image=image)
        self.session = self._sandbox
        self.ctx = ToolContext(self.session, task, memory=self.memory, embedding=self.embedding,
                               timeout_s=self.options.tool_timeout_s, run_cache=self.run_cache)
        text = self.format.prompt(self.tokenizer, task.prompt, self.toolbox.schemas())
        prompt = self.tokenizer.encode(text, add_bos=self.tokenizer.add_bos)
        self.context_len, self.turns, self.started = len(prompt), 0, time.monotonic()
        self.call_order: list[str] = []  # tools called, in order (e.g. tests run before finish?)
        self.bad_tool_calls = self.test_edit_attempts = 0
        self.lookups: Counter[str] = Counter()
        self._deleted_paths = [f.partition("::")[0] for f in task.metadata.get("feature", ())]
        self.turn_flags: list[dict[str, bool]] = []
        self._last_action: list[int] | None = None
        self._tests_before = self._test_files()
        return prompt

    def _test_files(self) -> dict[str, str]:
        paths = self.task.metadata.get("test_paths", ())
        return {p: c for p, c in self.session.files().items() if _under(p, paths)}

    def step(self, action: Sequence[int]) -> StepResult:
        if self.session is None:
            raise RuntimeError("step() before reset(), or after the episode ended")
        action = [int(t) for t in action]
        self.turns += 1
        self.context_len += len(action)
        parsed = self.format.parse(self.tokenizer.decode(action))
        lookups = []
        if isinstance(parsed, BadCall):
            out_text, bad, finished = f"error: {parsed.reason}", True, False
        else:
            lookups = lookup_flags(parsed.name, parsed.args, self._deleted_paths,
                                   self.session.workdir_inside)
            self.lookups.update(lookups)
            out = self.toolbox.call(self.ctx, parsed.name, parsed.args, self.options.max_output_chars)
            out_text, bad, finished = out.text, out.bad_call, out.finished
            if parsed.name in self.toolbox.tools:
                self.call_order.append(parsed.name)
        self.bad_tool_calls += bad
        tests_now = self._test_files()
        edited_tests = tests_now != self._tests_before
        self._tests_before = tests_now
        self.test_edit_attempts += edited_tests
        self.turn_flags.append({"bad_tool_call": bad, "test_edit": edited_tests,
                                "repeat": action == self._last_action, "lookup": bool(lookups)})
        self._last_action = action
        cut = self._budget_cut()
        if finished or cut:
            reward, info = self._grade(truncated=bool(cut) and not finished, why=cut)
            return StepResult([], reward, True, info)
        ended = bool(action) and action[-1] in self.tokenizer.stop_ids
        obs = self.tokenizer.encode(observation_text(self.tokenizer, out_text, ended))
        self.context_len += len(obs)
        if self.context_len >= self.options.max_context_tokens:  # no room for another action
            reward, info = self._grade(truncated=True, why="max_context_tokens")
            return StepResult([], reward, True, info)
        return StepResult(obs, 0.0, False, self._info())

    def _budget_cut(self) -> str:
        if self.turns >= self.options.max_turns:
            return "max_turns"
        if self.context_len >= self.options.max_context_tokens:
            return "max_context_tokens"
        if time.monotonic() - self.started > self.options.episode_timeout_s:
            return "episode_timeout"
        return ""

    def _info(self) -> dict[str, Any]:
        return {"turns": self.turns, "tool_calls": dict(Counter(self.call_order)),
                "call_order": list(self.call_order),
                "bad_tool_calls": self.bad_tool_calls, "test_edit_attempts": self.test_edit_attempts,
                "lookups": dict(self.lookups), "turn_flags": list(self.turn_flags),
                "cached_test_runs": self.ctx.cached_test_runs}

    def _grade(self, truncated: bool, why: str) -> tuple[float, dict[str, Any]]:
        task = self.task
        final = self.session.files()
        edited_tests = edited_test_files(task.files, final, task.metadata.get("test_paths", ()))
        edits = {p: c for p, c in final.items()
                 if task.files.get(p) != c and p not in edited_tests}
        if self.scorer is None:
            self.scorer = Scorer(workers=1, backend=self.backend)
        graded = self.scorer.submit(task, json.dumps(edits)).result()
        reward = graded.reward
        hack = graded.status == "hack" or bool(edited_tests)
        if edited_tests:  # discarded for grading, and the episode earns nothing
            reward = -self.scorer.config.hack_penalty  # as a `hack` verdict scores
        masked = truncated and self.options.truncation == "mask"
        if truncated and self.options.truncation == "penalty":
            reward -= self.options.truncation_penalty
        reward -= self.options.bad_call_penalty * self.bad_tool_calls
        if self.lookups and self.options.zero_lookup_reward:
            reward = min(reward, 0.0)
        info = {**self._info(), "status": graded.status, "passed": graded.passed,
                "grading": task.grading,
                "tests_passed": graded.result.tests_passed, "tests_total": graded.result.tests_total,
                "hack": hack, "edited_tests": edited_tests, "truncated": truncated,
                "truncated_by": why if truncated else "", "masked": masked}
        self.session = None
        return reward, info

    def _close_sandbox(self) -> None:
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None

    def close(self) -> None:
        self.session = None
        self._close_sandbox()
        if self._owns_scorer and self.scorer is not None:
            self.scorer.close()
            self.scorer = None
