"""`AgentRolloutProducer`: the `RolloutProducer` interface (what the orchestrator and trainer
consume) over multi-turn tool episodes.

A batch draws `prompts_per_step` repository tasks and plays each `group_size` times with
`run_episodes` (episodes in flight = the environments given). Rows are task-major groups; each
row is the episode's token-exact trajectory: the completion interleaves sampled actions
(`policy_mask` True, sampler log-probs) with tool output (mask False), and the reward is the
end-of-episode grade. Budget-cut episodes arrive `masked` (kept out of the advantage) or already
penalised, as the environment's options say; with `feedback_detectors`, each rollout lists
the turns they flagged (`Rollout.flagged`) for the trainer's targeted-feedback KL, and with
`feedback_teacher` "script" the scripted demonstration's call for each (`Rollout.corrections`). With
`scripted_prefix` (a reverse curriculum), that fraction of the groups start after the first k
calls of the task's scripted demonstration (`start_prefixes`). With `guidance`, that fraction
of the groups in which no episode passed get the task's scripted demonstration in place of
their worst episode (`guide`). Sampling
and tools interleave, so a batch is played to the end in the calling (producer) thread; the
returned future is already resolved.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from rollouts.agent.demos import EDIT_TOOLS, demonstrate, scripted_calls, scripted_corrections
from rollouts.agent.feedback import flagged_turns
from rollouts.agent.formats import ToolCall
from rollouts.agent.metrics import agent_metrics
from rollouts.agent.rollout import run_episodes
from rollouts.environment import INFRA_ERROR, Environment, Trajectory
from rollouts.producer import Rollout, RolloutBatch, batch_seed, rollout_stats
from rollouts.sampler import Sampler, continuation
from rollouts.tasks import Task


class AgentRolloutProducer:
    def __init__(self, sampler: Sampler, tokenizer, tasks: Iterator[Task],
                 envs: Sequence[Environment], *, prompts_per_step: int, group_size: int,
                 max_action_tokens: int, temperature: float, seed: int,
                 top_k: int | None = None, top_p: float | None = None,
                 feedback_detectors: Sequence[str] = (), feedback_teacher: str = "hint",
                 scripted_prefix: float = 0.0, guidance: float = 0.0, edit_tool: str = "edit"):
        if not envs:
            raise ValueError("AgentRolloutProducer needs at least one environment")
        self.sampler, self.tokenizer, self.tasks, self.envs = sampler, tokenizer, tasks, envs
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.max_action_tokens, self.temperature = max_action_tokens, temperature
        self.top_k, self.top_p, self.seed = top_k, top_p, seed
        self.feedback_detectors = tuple(feedback_detectors)
        self.feedback_teacher = feedback_teacher
        self.scripted_prefix, self.guidance, self.edit_tool = scripted_prefix, guidance, edit_tool
        self.demos: dict[str, Trajectory] = {}  # task id -> its scripted demonstration

    def start_prefixes(self, index: int, tasks: Sequence[Task]) -> list[list[ToolCall]]:
        """Per task (group) of batch `index`: the scripted calls its episodes play before the
        policy's first turn. A `scripted_prefix` fraction of the groups get the first k calls of
        `scripted_calls(task, edit_tool)`, k uniform in 1 .. the calls before its first edit;
        the others none. Drawn from (seed, index) alone, so a resumed run replays them; a
        group's episodes share one start state, so the leave-one-out baseline compares like
        with like."""
        if not self.scripted_prefix:
            return [[] for _ in tasks]
        rng = random.Random(f"scripted_prefix:{self.seed}:{index}")
        prefixes = []
        for task in tasks:
            if rng.random() >= self.scripted_prefix:
                prefixes.append([])
                continue
            try:
                calls = scripted_calls(task, self.edit_tool)
            except ValueError as e:  # e.g. a deletion task: no reference to script
                raise ValueError(f"agent.scripted_prefix needs scripted tasks: {e}") from None
            before_edit = next(i for i, c in enumerate(calls) if c.name in EDIT_TOOLS)
            prefixes.append(calls[:rng.randint(1, before_edit)])
        return prefixes

    def guide(self, index: int, tasks: Sequence[Task], rollouts: list[Rollout], version: int,
              prefixes: Sequence[Sequence[ToolCall]] = ()) -> int:
        """Off-policy guidance: in a `guidance` fraction of the groups (drawn from seed and
        `index` alone, so a resumed run replays them) whose scored episodes all failed, the
        worst episode (the last of the lowest reward) becomes the task's scripted
        demonstration played in the environment (`demonstrate`), if that passes; in place in
        `rollouts`. Returns the number of groups guided. A group with an environment failure
        (its episodes' outcome unknown) or a scripted prefix (`prefixes[i]`: another start
        state than the demonstration's) is left alone."""
        rng, g = random.Random(f"guidance:{self.seed}:{index}"), self.group_size
        chosen = []
        for i in range(len(tasks)):
            group = rollouts[i * g:(i + 1) * g]
            drawn = rng.random() < self.guidance  # drawn for every group: the same draws on resume
            if drawn and not (prefixes and prefixes[i]) and all(
                    r.status not in ("passed", INFRA_ERROR) for r in group):
                chosen.append(i)
        missing = list(dict.fromkeys(tasks[i].id for i in chosen if tasks[i].id not in self.demos))
        if missing:  # a task's demonstration is the same each time: played once, one per env
            by_id = {t.id: t for t in tasks}

            def play(env: Environment, ids: list[str]) -> list[Trajectory]:
                try:
                    scripts = [scripted_calls(by_id[t], self.edit_tool) for t in ids]
                except ValueError as e:  # e.g. a deletion task: no reference to script
                    raise ValueError(f"agent.guidance needs scripted tasks: {e}") from None
                return [demonstrate(env, by_id[t], calls) for t, calls in zip(ids, scripts)]

            shares = [missing[k::len(self.envs)] for k in range(len(self.envs))]
            with ThreadPoolExecutor(len(self.envs)) as pool:
                for ids, trajs in zip(shares, pool.map(play, self.envs, shares)):
                    self.demos.update(zip(ids, trajs))
        guided = 0
        for i in chosen:
            demo = self.demos[tasks[i].id]
            if demo.info.get("status") != "passed":
                continue
            group = rollouts[i * g:(i + 1) * g]
            worst = i * g + max(range(g), key=lambda k: (-group[k].reward, k))
            rollouts[worst] = dataclasses.replace(
                Rollout.from_trajectory(demo, "stop"), version=version, guided=True)
            guided += 1
        return guided

    def start(self, index: int, version: int) -> Future:
        """Play batch `index` with the sampler's current weights (policy `version`); returns a
        resolved future of the `RolloutBatch`."""
        tasks = [next(self.tasks) for _ in range(self.prompts_per_step)]
        cont = continuation(self.sampler, len(self.envs), max_new_tokens=self.max_action_tokens,
                            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                            stop_token_ids=self.tokenizer.stop_ids,
                            seed=batch_seed(self.seed, index))
        t0, timing = time.perf_counter(), {}
        prefixes = self.start_prefixes(index, tasks)
        episodes = [t for t in tasks for _ in range(self.group_size)]
        episode_prefixes = [p for p in prefixes for _ in range(self.group_size)]
        trajs = run_episodes(cont, self.envs, episodes, version, timing, prefixes=episode_prefixes)
        rollouts = [Rollout.from_trajectory(t, t.info.get("truncated_by") or "stop")
                    for t in trajs]
        if self.feedback_detectors:  # the turns the trainer's feedback KL applies to
            for r, t, task, prefix in zip(rollouts, trajs, episodes, episode_prefixes, strict=True):
                r.flagged = flagged_turns(t, self.feedback_detectors)
                if self.feedback_teacher == "script" and r.flagged:
                    r.corrections = scripted_corrections(t, task, r.flagged, self.envs[0].format,
                                                         self.tokenizer, self.edit_tool, prefix)
        # Tools and grading run inside the episodes: all of it counts as generation time, of
        # which time/tools_s was spent in the environments.
        # the policy's own episodes: measured before any is replaced by a demonstration
        stats = {**rollout_stats(rollouts, time.perf_counter() - t0, 0.0),
                 **agent_metrics(trajs, episodes), "time/tools_s": timing["tools_s"]}
        if self.guidance:
            t1 = time.perf_counter()
            guided = self.guide(index, tasks, rollouts, version, prefixes)
            stats["agent/guided_groups"] = guided / len(tasks)
            stats["time/guidance_s"] = time.perf_counter() - t1
        batch: Future = Future()
        batch.set_result(RolloutBatch(version, self.group_size, rollouts, stats))
        return batch

    def produce(self, index: int, version: int) -> RolloutBatch:
        return self.start(index, version).result()

    def update_weights(self, params) -> None:
        self.sampler.update_weights(params)

    def task_state(self):
        return self.tasks.get_state()

    def close(self) -> None:
        for env in self.envs:
            env.close()
