"""The rollout producer: tasks -> environments -> sampler -> completions -> sandbox rewards.

Every rollout is an episode of an `Environment`; a single-turn code task (`CodeTaskEnv`) is a
one-step episode: `reset` encodes the prompt, `step(completion tokens)` runs the tests in the
sandbox and ends the episode. The tokens the trainer trains on are the ids the sampler produced.

`RolloutProducer.start(index, version)` samples one batch in the calling thread, then hands
every completion's `env.step` to a thread pool and returns at once with a future of the scored
batch, so the next batch can be sampled while slow test suites still run. An exception raised
by `env.step` (a sandbox crash, not the solution's fault) marks the rollout `infra_error`: it
is counted and kept out of the advantages, never scored 0.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np

from rollouts.environment import INFRA_ERROR, Environment, StepResult, Trajectory, safe_step
from rollouts.rewards import Scorer
from rollouts.sampler import Sampler
from rollouts.tasks import Task


class Producer(Protocol):
    """What the orchestrator drives (`RolloutProducer`: single completions,
    `rollouts.agent.producer.AgentRolloutProducer`: tool episodes)."""

    def update_weights(self, params) -> None:
        """Sample the next batches with `params`."""

    def start(self, index: int, version: int) -> Future:
        """Batch `index`, sampled with weights `version`: a future of the scored batch."""

    def task_state(self) -> Any:
        """The task iterator's state (a checkpoint's, before the next batch's draw)."""

    def close(self) -> None: ...


def batch_seed(seed: int, index: int, draw: int = 0) -> int:
    """The sampling seed of batch `index` (`draw` > 0: its refills): the run seed and the batch
    index alone, so a resumed run draws the same completions as an uninterrupted one."""
    return (seed * 1_000_003 + index) * (1 + 7919 * draw) + draw


@dataclasses.dataclass
class Rollout:
    task_id: str
    prompt: list[int]
    completion: list[int]  # token-exact, as sampled (stop token included)
    policy_mask: list[bool]  # per completion token: True where the policy sampled it
    logprobs: list[float]  # the sampler's log-prob of each completion token
    text: str  # decoded completion, stop tokens removed: what the sandbox ran
    reward: float
    status: str  # sandbox verdict (passed, failed, error, timeout, oom, hack) or infra_error
    finish_reason: str  # stop | length
    version: int  # policy version (train step) that sampled it
    masked: bool = False  # a budget-cut agent episode kept out of the advantage
    grading: str = "isolated"  # where its tests ran (rollouts.tasks.Task.grading)
    # (start, end, detector) of the agent turns a feedback detector flagged, in prompt +
    # completion coordinates (rollouts.agent.feedback.flagged_turns)
    flagged: list = dataclasses.field(default_factory=list)
    # the scripted teacher's call (tokens) for each flagged turn (agent.feedback_teacher script)
    corrections: list = dataclasses.field(default_factory=list)
    lookups: dict = dataclasses.field(default_factory=dict)  # look-up kind -> tool calls (agent.monitor)
    # a scripted demonstration in place of a sampled episode (agent.guidance): its log-probs
    # are placeholders, the trainer takes the policy's own
    guided: bool = False

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_trajectory(cls, traj: Trajectory, finish_reason: str) -> Rollout:
        n = traj.prompt_len
        return cls(traj.task_id, traj.tokens[:n], traj.tokens[n:], traj.policy_mask[n:],
                   traj.logprobs[n:], traj.info.get("text", ""), traj.reward,
                   traj.info.get("status", ""), finish_reason, traj.version,
                   bool(traj.info.get("masked")), grading=traj.info.get("grading", "isolated"),
                   lookups=dict(traj.info.get("lookups", {})))


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

    def valid(self) -> np.ndarray:
        """[num_groups, G] bool: False where there is no reward to learn from (the environment
        failed, or a budget-cut episode is masked)."""
        return np.asarray([r.status != INFRA_ERROR and not r.masked
                           for r in self.rollouts]).reshape(
            -1, self.group_size)

    def groups_with_signal(self) -> np.ndarray:
        """[num_groups] bool: at least two scored rollouts whose rewards differ (DAPO's
        dynamic-sampling filter: an all-equal group has zero advantage, so no gradient)."""
        rewards, valid = self.rewards(), self.valid()
        return np.asarray([v.sum() >= 2 and np.ptp(r[v]) > 1e-6 for r, v in zip(rewards, valid)])

    def group_signals(self) -> list[tuple[str, bool]]:
        """(task id, whether the group's rewards differ: `groups_with_signal`) per group."""
        g = self.group_size
        return [(self.rollouts[i * g].task_id, bool(signal))
                for i, signal in enumerate(self.groups_with_signal())]

    def group_outcomes(self) -> list[tuple[str, bool]]:
        """(task id, whether every rollout of the group passed) per group. An environment
        failure does not count against it (not the policy's doing); a budget-cut episode
        does unless it passed; a group with nothing but environment failures is not solved."""
        g = self.group_size
        groups = [self.rollouts[i:i + g] for i in range(0, len(self.rollouts), g)]
        scored = [[r for r in group if r.status != INFRA_ERROR] for group in groups]
        return [(group[0].task_id, bool(s) and all(r.status == "passed" for r in s))
                for group, s in zip(groups, scored)]

    def to_json(self) -> dict:
        return {"version": self.version, "group_size": self.group_size, "stats": self.stats,
                "rollouts": [r.to_json() for r in self.rollouts]}

    @classmethod
    def from_json(cls, data: dict) -> RolloutBatch:
        return cls(data["version"], data["group_size"],
                   [Rollout(**r) for r in data["rollouts"]], data["stats"])


class CodeTaskEnv(Environment):
    """A single-turn code task: the prompt, one completion, the sandbox's verdict, done."""

    def __init__(self, tokenizer, scorer: Scorer):
        self.tokenizer, self.scorer = tokenizer, scorer
        self.task: Task | None = None

    def reset(self, task: Task) -> list[int]:
        self.task = task
        return self.tokenizer.encode(task.prompt, add_bos=self.tokenizer.add_bos)

    def step(self, action: Sequence[int]) -> StepResult:
        if self.task is None:
            raise RuntimeError("CodeTaskEnv.step before reset")
        text = self.tokenizer.decode(action)
        reward = self.scorer.submit(self.task, text).result()
        return StepResult([], reward.reward, True,
                          {"status": reward.status, "text": text, "grading": self.task.grading})


def _run_step(env: Environment, traj: Trajectory, action: Sequence[int]) -> Trajectory:
    traj.record(safe_step(env, action))
    return traj


def sample_episodes(sampler: Sampler, envs: Sequence[Environment], tasks: Sequence[Task],
                    pool: ThreadPoolExecutor, *, num_samples: int, max_new_tokens: int,
                    temperature: float, seed: int, stop_token_ids: Sequence[int] = (),
                    version: int = 0, top_k: int | None = None,
                    top_p: float | None = None, row_offset: int = 0,
                    graded: range | None = None) -> Future:
    """Sample `num_samples` completions per task (rows task-major, one environment per row)
    and submit each row's environment step as soon as its completion is finished (the sandbox
    runs while the sampler decodes the longer rows); returns a future of (rollouts, stats)
    that resolves when the last reward is in. `graded`: the rows whose environments step and
    whose rollouts come back (default: all); every process samples the whole batch when the
    sampler's weights span them all, and steps its share."""
    if len(envs) != len(tasks) * num_samples:
        raise ValueError(f"{len(envs)} environments for {len(tasks)} tasks x {num_samples}")
    graded = range(len(envs)) if graded is None else graded
    t0 = time.perf_counter()
    row_tasks = [t for t in tasks for _ in range(num_samples)]
    row_prompts = [env.reset(task) for env, task in zip(envs, row_tasks)]
    prompts = row_prompts[::num_samples]  # a group shares its prompt: prefilled once
    steps: dict[int, Future] = {}

    def submit(row, tokens, logprobs, _reason):
        if row not in graded:
            return
        traj = Trajectory.start(row_tasks[row].id, row_prompts[row], version)
        traj.add_action(tokens, logprobs)
        steps[row] = pool.submit(_run_step, envs[row], traj, tokens)

    out = sampler.generate(prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_k=top_k, top_p=top_p,
                           stop_token_ids=stop_token_ids, seed=seed, on_finish=submit,
                           row_offset=row_offset)
    t1 = time.perf_counter()

    result: Future = Future()
    remaining = [len(steps)]
    lock = threading.Lock()

    def finish(_):
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        try:
            rollouts = [Rollout.from_trajectory(steps[row].result(), out.finish_reasons[row])
                        for row in graded]
            stats = rollout_stats(rollouts, t1 - t0, time.perf_counter() - t1)
            result.set_result((rollouts, stats))
        except Exception as e:  # noqa: BLE001 - delivered to whoever waits on the batch
            result.set_exception(e)

    if not steps:  # no row of the batch is graded here: no rollouts, no stats
        result.set_result(([], {}))
    for s in list(steps.values()):
        s.add_done_callback(finish)
    return result


def rollout_stats(rollouts: list[Rollout], generate_s: float, reward_s: float) -> dict:
    generated = sum(len(r.completion) for r in rollouts)
    statuses = [r.status for r in rollouts]
    scored = [r.reward for r in rollouts if r.status != INFRA_ERROR]
    return {
        "rollout/reward_mean": float(np.mean(scored)) if scored else float("nan"),
        "rollout/pass_rate": statuses.count("passed") / len(statuses),
        "rollout/hack_rate": statuses.count("hack") / len(statuses),
        "rollout/infra_failures": statuses.count(INFRA_ERROR),
        # graded with pytest beside the solution's code (weaker: see docs/sandbox.md)
        "reward/in_process_fraction": sum(r.grading == "in-process" for r in rollouts) / len(rollouts),
        "rollout/completion_len": generated / len(rollouts),
        "rollout/tokens_per_s": generated / max(generate_s, 1e-9),
        "time/generate_s": generate_s,
        "time/reward_s": reward_s,  # from the end of sampling to the last verdict
    }


def sample_and_score(sampler: Sampler, tokenizer, scorer: Scorer, tasks: list[Task], *,
                     num_samples: int, max_new_tokens: int, temperature: float, seed: int,
                     version: int = 0, graded: range | None = None
                     ) -> tuple[list[Rollout], dict]:
    """G completions per task, scored in the sandbox; rows are task-major. Blocking.
    `graded`: the rows scored and returned (`sample_episodes`)."""
    envs = [CodeTaskEnv(tokenizer, scorer) for _ in range(len(tasks) * num_samples)]
    # Steps mostly wait on the sandbox; enough threads to keep its workers busy.
    with ThreadPoolExecutor(min(len(envs), 64)) as pool:
        return sample_episodes(sampler, envs, tasks, pool, num_samples=num_samples,
                               max_new_tokens=max_new_tokens, temperature=temperature,
                               seed=seed, stop_token_ids=tokenizer.stop_ids,
                               version=version, graded=graded).result()


class RolloutProducer:
    """Draws `prompts_per_step` tasks per batch from an iterator (whose state checkpoints) and
    runs them as episodes of `make_env()` environments (default: `CodeTaskEnv`)."""

    def __init__(self, sampler: Sampler, tokenizer, scorer: Scorer, tasks: Iterator[Task], *,
                 prompts_per_step: int, group_size: int, max_new_tokens: int,
                 temperature: float, seed: int, top_k: int | None = None,
                 top_p: float | None = None,
                 make_env: Callable[[], Environment] | None = None, in_flight: int = 2,
                 refill_draws: int = 0, row_offset: int = 0):
        self.sampler, self.tokenizer, self.scorer = sampler, tokenizer, scorer
        # DAPO dynamic sampling: up to this many more draws of prompts_per_step tasks while
        # the batch holds fewer groups with signal (then scored before the next batch starts)
        self.refill_draws = refill_draws
        # This process's rows of the global batch start here (their sampling keys are global)
        self.row_offset = row_offset
        self.tasks = tasks
        self.prompts_per_step = prompts_per_step
        self.group_size = group_size
        self.max_new_tokens = max_new_tokens
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.seed = seed
        self.make_env = make_env or (lambda: CodeTaskEnv(tokenizer, scorer))
        rows = prompts_per_step * group_size
        # Environment steps mostly wait on the sandbox: one thread per row of every batch
        # that may be scoring at once.
        self.pool = ThreadPoolExecutor(rows * in_flight, thread_name_prefix="env-step")

    def start(self, index: int, version: int) -> Future:
        """Sample batch `index` with the sampler's current weights (policy `version`); returns
        a future of the scored `RolloutBatch`. With `refill_draws`, groups without signal are
        replaced by those of further draws (each scored first, so this blocks) until the batch
        holds `prompts_per_step` groups with signal or the draws run out; groups without
        signal fill what remains (the advantage masks them)."""
        first = self._draw(index, version, 0)
        if not self.refill_draws:
            return first
        draws = [first.result()]
        signal = [draws[0].groups_with_signal()]
        while sum(s.sum() for s in signal) < self.prompts_per_step and len(draws) <= self.refill_draws:
            draws.append(self._draw(index, version, len(draws)).result())
            signal.append(draws[-1].groups_with_signal())
        g = self.group_size
        groups = [(b, i) for b, s in zip(draws, signal) for i in np.flatnonzero(s)]
        kept = min(len(groups), self.prompts_per_step)
        groups += [(b, i) for b, s in zip(draws, signal) for i in np.flatnonzero(~s)]
        rollouts = [r for b, i in groups[:self.prompts_per_step] for r in b.rollouts[i * g:(i + 1) * g]]
        stats = rollout_stats(rollouts, sum(b.stats["time/generate_s"] for b in draws),
                              sum(b.stats["time/reward_s"] for b in draws))
        stats.update({"rollout/groups_drawn": len(draws) * self.prompts_per_step,
                      "rollout/groups_kept": kept})
        done: Future = Future()
        done.set_result(RolloutBatch(version, g, rollouts, stats))
        return done

    def _draw(self, index: int, version: int, draw: int) -> Future:
        """prompts_per_step tasks, sampled and scored; draw > 0: a refill of batch `index`."""
        tasks = [next(self.tasks) for _ in range(self.prompts_per_step)]
        envs = [self.make_env() for _ in range(len(tasks) * self.group_size)]
        episodes = sample_episodes(
            self.sampler, envs, tasks, self.pool, num_samples=self.group_size,
            max_new_tokens=self.max_new_tokens, temperature=self.temperature,
            seed=batch_seed(self.seed, index, draw),
            stop_token_ids=self.tokenizer.stop_ids, version=version, top_k=self.top_k,
            top_p=self.top_p, row_offset=self.row_offset)
        batch: Future = Future()

        def done(f: Future) -> None:
            if f.exception() is not None:
                batch.set_exception(f.exception())
            else:
                rollouts, stats = f.result()
                batch.set_result(RolloutBatch(version, self.group_size, rollouts, stats))

        episodes.add_done_callback(done)
        return batch

    def produce(self, index: int, version: int) -> RolloutBatch:
        return self.start(index, version).result()

    def update_weights(self, params) -> None:
        self.sampler.update_weights(params)

    def task_state(self) -> Any:
        return self.tasks.get_state()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)
