"""The rollout producer: tasks -> prompts -> sampler -> completions -> sandbox rewards.

It hands the trainer versioned batches of scored rollouts (G consecutive rows per task). The
synchronous loop calls `produce(version)` then trains; the async schedule runs the same call
in a thread.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

import numpy as np

from rollouts.rewards import Scorer
from rollouts.sampler import Sampler
from rollouts.tasks import Task


@dataclasses.dataclass
class Rollout:
    task_id: str
    prompt: list[int]
    completion: list[int]  # token-exact, as sampled (stop token included)
    logprobs: list[float]  # the sampler's log-prob of each completion token
    text: str  # decoded completion, stop tokens removed: what the sandbox ran
    reward: float
    status: str  # sandbox verdict: passed, failed, error, timeout, oom, hack
    finish_reason: str  # stop | length
    version: int  # policy version (train step) that sampled it

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RolloutBatch:
    version: int
    group_size: int
    rollouts: list[Rollout]  # groups of `group_size` consecutive rows
    stats: dict

    def rewards(self) -> np.ndarray:
        """[num_groups, G]"""
        return np.asarray([r.reward for r in self.rollouts], np.float64).reshape(
            -1, self.group_size)


def sample_and_score(sampler: Sampler, tokenizer, scorer: Scorer, tasks: list[Task], *,
                     num_samples: int, max_new_tokens: int, temperature: float, seed: int,
                     version: int = 0) -> tuple[list[Rollout], dict]:
    """G completions per task, scored in the sandbox; rows are task-major."""
    t0 = time.perf_counter()
    prompts = [tokenizer.encode(t.prompt, add_bos=getattr(tokenizer, "add_bos", False))
               for t in tasks]
    out = sampler.generate(prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
                           temperature=temperature, stop_token_ids=tokenizer.stop_ids,
                           seed=seed)
    t1 = time.perf_counter()
    texts = [tokenizer.decode(tokens) for tokens in out.tokens]
    row_tasks = [t for t in tasks for _ in range(num_samples)]
    rewards = scorer.score_batch(row_tasks, texts)
    t2 = time.perf_counter()
    rollouts = [
        Rollout(task.id, prompts[i // num_samples], tokens, [float(x) for x in lps], text,
                float(r.reward), r.status, reason, version)
        for i, (task, tokens, lps, text, r, reason) in enumerate(
            zip(row_tasks, out.tokens, out.logprobs, texts, rewards, out.finish_reasons))
    ]
    generated = sum(len(r.completion) for r in rollouts)
    statuses = [r.status for r in rollouts]
    stats = {
        "rollout/reward_mean": float(np.mean([r.reward for r in rollouts])),
        "rollout/pass_rate": statuses.count("passed") / len(statuses),
        "rollout/hack_rate": statuses.count("hack") / len(statuses),
        "rollout/completion_len": generated / len(rollouts),
        "rollout/tokens_per_s": generated / max(t1 - t0, 1e-9),
        "time/generate_s": t1 - t0,
        "time/reward_s": t2 - t1,
    }
    return rollouts, stats


class RolloutProducer:
    """Draws `prompts_per_step` tasks per batch from an iterator (whose state checkpoints)."""

    def __init__(self, sampler: Sampler, tokenizer, scorer: Scorer, tasks: Iterator[Task], *,
                 prompts_per_step: int, group_size: int, max_new_tokens: int,
                 temperature: float, seed: int):
        self.sampler, self.tokenizer, self.scorer = sampler, tokenizer, scorer
        self.tasks = tasks
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed

    def produce(self, version: int) -> RolloutBatch:
        tasks = [next(self.tasks) for _ in range(self.prompts_per_step)]
        # The sampling seed depends only on the run seed and the version, so a resumed run
        # draws the same completions as an uninterrupted one.
        rollouts, stats = sample_and_score(
            self.sampler, self.tokenizer, self.scorer, tasks, num_samples=self.group_size,
            max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            seed=self.seed * 1_000_003 + version, version=version)
        return RolloutBatch(version, self.group_size, rollouts, stats)
