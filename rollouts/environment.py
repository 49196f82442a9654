"""Rollouts are episodes of an environment.

    obs_0 = env.reset(task)                      # prompt tokens
    obs_1, r, done, info = env.step(action_0)    # action = the tokens the policy sampled
    ...

A single-turn code task is a one-step episode whose reward comes from the sandbox; a multi-turn
tool agent returns tool output as the observation and finishes when the agent calls `finish`
or a budget runs out. A `Trajectory` records the episode token-exactly: the ids the sampler
produced are the ids the trainer trains on (never decoded and re-encoded), with a mask that
marks the policy's tokens and the sampler's log-prob of each.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

INFRA_ERROR = "infra_error"  # status of an episode whose environment step raised


class StepResult(NamedTuple):
    observation: list[int]  # tokens appended to the context after the action ([] when done)
    reward: float
    done: bool
    info: dict[str, Any]


class Environment(abc.ABC):
    """One episode at a time; `reset` starts a new one. Implementations own their side effects
    (sandbox sessions) and release them in `close`."""

    @abc.abstractmethod
    def reset(self, task) -> list[int]:
        """Start an episode on `task`; returns the initial observation (the prompt's ids)."""

    @abc.abstractmethod
    def step(self, action: Sequence[int]) -> StepResult:
        """Apply the policy's sampled tokens; returns (observation, reward, done, info)."""

    def close(self) -> None:
        """Release resources held across episodes."""


@dataclasses.dataclass
class Trajectory:
    """An episode as one token sequence: prompt, then alternating actions and observations."""

    task_id: str
    tokens: list[int]
    policy_mask: list[bool]  # True where the policy sampled the token (the loss covers these)
    logprobs: list[float]  # the sampler's log-prob at policy tokens, 0.0 elsewhere
    prompt_len: int
    version: int  # policy version (train step) that sampled the first action
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def start(cls, task_id: str, prompt: Sequence[int], version: int) -> Trajectory:
        prompt = [int(t) for t in prompt]
        return cls(task_id, prompt, [False] * len(prompt), [0.0] * len(prompt), len(prompt),
                   version)

    def add_action(self, tokens: Sequence[int], logprobs: Sequence[float]) -> None:
        if len(tokens) != len(logprobs):
            raise ValueError(f"action has {len(tokens)} tokens but {len(logprobs)} logprobs")
        self.tokens += [int(t) for t in tokens]
        self.policy_mask += [True] * len(tokens)
        self.logprobs += [float(x) for x in logprobs]

    def add_observation(self, tokens: Sequence[int]) -> None:
        self.tokens += [int(t) for t in tokens]
        self.policy_mask += [False] * len(tokens)
        self.logprobs += [0.0] * len(tokens)

    def record(self, result: StepResult) -> None:
        """Fold one `env.step` result in: observation tokens, reward, termination, info."""
        self.add_observation(result.observation)
        self.reward += float(result.reward)
        self.done = result.done
        self.info.update(result.info)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens int32, policy_mask bool, logprobs float32), each [len(tokens)]."""
        return (np.asarray(self.tokens, np.int32), np.asarray(self.policy_mask, bool),
                np.asarray(self.logprobs, np.float32))


def safe_step(env: Environment, action) -> StepResult:
    """`env.step(action)`, or, when the environment's infrastructure raises (a sandbox crash,
    not the policy's doing), the episode's end with status `infra_error`: no reward to learn
    from, and the other episodes go on."""
    try:
        return env.step(action)
    except Exception as e:  # noqa: BLE001 - the environment failed, not the policy
        return StepResult([], 0.0, True, {"status": INFRA_ERROR, "error": repr(e)})
