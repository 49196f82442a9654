"""Run many tool episodes concurrently on one `Continuation`: one episode per slot, every
active episode takes a turn together, tools run in parallel threads, and a finished episode's
slot is refilled from the task queue at once so the batch stays full."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from rollouts.environment import Environment, Trajectory
from rollouts.sampler import Continuation


def run_episodes(cont: Continuation, envs: Sequence[Environment], tasks: Iterable,
                 version: int = 0) -> list[Trajectory]:
    """Play every task to the end with `len(envs)` episodes in flight; trajectories in the
    order the episodes finished."""
    if len(envs) > cont.slots:
        raise ValueError(f"{len(envs)} environments but the continuation has {cont.slots} slots")
    queue = iter(tasks)
    live: dict[int, Trajectory] = {}
    finished: list[Trajectory] = []

    def fill(slot: int) -> None:
        task = next(queue, None)
        if task is not None:
            prompt = envs[slot].reset(task)
            cont.start(slot, prompt)
            live[slot] = Trajectory.start(task.id, prompt, version)

    for slot in range(len(envs)):
        fill(slot)
    with ThreadPoolExecutor(max(1, len(envs))) as pool:
        while live:
            actions = cont.turn()
            for slot, (tokens, logprobs, _) in actions.items():
                live[slot].add_action(tokens, logprobs)
            futures = {slot: pool.submit(envs[slot].step, actions[slot][0]) for slot in actions}
            for slot, future in futures.items():
                result = future.result()
                traj = live[slot]
                traj.record(result)
                if result.done:
                    finished.append(traj)
                    del live[slot]
                    cont.release(slot)
                    fill(slot)
                else:
                    cont.append(slot, result.observation)
    return finished
