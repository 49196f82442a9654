"""Agent metrics over finished episodes: the reverse curriculum's split by start state, the
pass rate by task family."""

from __future__ import annotations

import pytest

from rollouts.agent.metrics import agent_metrics
from rollouts.environment import Trajectory
from rollouts.tasks.task import Task


def _episode(reward: float, prefix_calls: int) -> Trajectory:
    traj = Trajectory.start("t", [1, 2, 3], version=0)
    traj.reward, traj.done = reward, True
    traj.info = {"passed": reward == 1.0, "turns": 4, **({"prefix_calls": prefix_calls}
                                                         if prefix_calls else {})}
    return traj


def test_metrics_split_episodes_started_after_scripted_calls_from_those_from_the_start():
    trajs = [_episode(1.0, 2), _episode(0.0, 1), _episode(1.0, 3), _episode(0.0, 0),
             _episode(1.0, 0), _episode(0.0, 0), _episode(0.0, 0)]
    m = agent_metrics(trajs)
    assert m["agent/prefix_fraction"] == pytest.approx(3 / 7)
    assert m["agent/prefix_calls_mean"] == pytest.approx(2.0)
    assert m["agent/pass_rate_from_prefix"] == m["agent/reward_mean_from_prefix"] == pytest.approx(2 / 3)
    assert m["agent/pass_rate_from_start"] == m["agent/reward_mean_from_start"] == pytest.approx(1 / 4)
    assert m["agent/pass_rate"] == pytest.approx(3 / 7)
    unprefixed = agent_metrics(trajs[3:])  # no curriculum: no split keys
    assert not [k for k in unprefixed if "prefix" in k or "from_start" in k]
    assert "agent/pass_rate_from_start" not in agent_metrics(trajs[:3])


def test_pass_rate_by_family():
    trajs = [_episode(r, 0) for r in (1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.0)]
    families = ["constant", "constant", "exception", "exception", "exception", "", "edge_case"]
    tasks = [Task(f"t{i}", "", "f", (), metadata={"family": f} if f else {})
             for i, f in enumerate(families)]
    m = agent_metrics(trajs, tasks)
    assert m["agent/pass_rate/constant"] == pytest.approx(1 / 2)
    assert m["agent/pass_rate/exception"] == pytest.approx(2 / 3)
    assert m["agent/pass_rate/edge_case"] == 0.0
    assert len([k for k in m if k.startswith("agent/pass_rate/")]) == 3  # none for ""
    assert not [k for k in agent_metrics(trajs) if k.startswith("agent/pass_rate/")]
    with pytest.raises(ValueError):
        agent_metrics(trajs, tasks[:-1])
