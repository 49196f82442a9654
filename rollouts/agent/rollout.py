"""Run many tool episodes concurrently on one `Continuation`: one episode per slot, every
active episode takes a turn together, tools run in parallel threads, and a finished episode's
slot is refilled from the task queue at once so the batch stays full. An episode may start
after scripted calls (a reverse curriculum's start state near the goal)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from rollouts.agent.demos import scripted_start
from rollouts.agent.formats import ToolCall
from rollouts.environment import Environment, Trajectory, safe_step
from rollouts.sampler import Continuation, ThreadedContinuation


def run_episodes(cont: Continuation | ThreadedContinuation, envs: Sequence[Environment],
                 tasks: Iterable, version: int = 0, timing: dict[str, float] | None = None,
                 on_done: Callable[[Trajectory], None] | None = None,
                 prefixes: Sequence[Sequence[ToolCall]] = ()) -> list[Trajectory]:
    """Play every task to the end with `len(envs)` episodes in flight; trajectories in the
    order of `tasks`. An episode whose environment step raises ends there with status
    `infra_error` (no reward to learn from) instead of failing the others. `timing`, if
    given, gets `tools_s` added: the wall time spent in environments (resets, tool calls,
    grading) rather than sampling. `on_done(trajectory)` is called as each episode ends (a
    progress bar). `prefixes[i]`, if given, are scripted calls episode i plays before the
    policy's first turn (`scripted_start`: they join its prompt); empty: from the start."""
    if len(envs) > cont.slots:
        raise ValueError(f"{len(envs)} environments but the continuation has {cont.slots} slots")
    tools_s = 0.0
    queue = enumerate(tasks)
    live: dict[int, tuple[int, Trajectory]] = {}  # slot -> (task index, trajectory)
    finished: dict[int, Trajectory] = {}

    def fill(slot: int) -> None:
        nonlocal tools_s
        for index, task in queue:
            t0 = time.perf_counter()
            calls = prefixes[index] if prefixes else ()
            traj = (scripted_start(envs[slot], task, calls, version) if calls
                    else Trajectory.start(task.id, envs[slot].reset(task), version))
            tools_s += time.perf_counter() - t0
            if not traj.done:
                cont.start(slot, traj.tokens)
                live[slot] = index, traj
                return
            finished[index] = traj  # the scripted calls used up a budget: nothing to sample
            if on_done is not None:
                on_done(traj)

    for slot in range(len(envs)):
        fill(slot)
    with ThreadPoolExecutor(max(1, len(envs))) as pool:
        while live:
            actions = cont.turn()
            for slot, (tokens, logprobs, _) in actions.items():
                live[slot][1].add_action(tokens, logprobs)
            t0 = time.perf_counter()
            futures = {slot: pool.submit(safe_step, envs[slot], actions[slot][0]) for slot in actions}
            results = {slot: future.result() for slot, future in futures.items()}
            tools_s += time.perf_counter() - t0
            for slot, result in results.items():
                index, traj = live[slot]
                traj.record(result)
                if result.done:
                    finished[index] = traj
                    if on_done is not None:
                        on_done(traj)
                    del live[slot]
                    cont.release(slot)
                    fill(slot)
                else:
                    cont.append(slot, result.observation)
    if timing is not None:
        timing["tools_s"] = timing.get("tools_s", 0.0) + tools_s
    return [finished[i] for i in sorted(finished)]
