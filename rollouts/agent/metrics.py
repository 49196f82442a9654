"""Agent metrics over finished episodes (the `agent/...` scalars of the metrics log)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rollouts.environment import Trajectory
from rollouts.tasks.task import Task


def ran_tests_before_finish(info: dict) -> bool:
    """Whether the episode called `run_tests` before its (last) `finish`."""
    order = info.get("call_order", [])
    end = len(order) - 1 - order[::-1].index("finish") if "finish" in order else len(order)
    return "run_tests" in order[:end]


def agent_metrics(trajs: Sequence[Trajectory],
                  tasks: Sequence[Task] | None = None) -> dict[str, float]:
    """turns_mean, tool_calls (total and per tool), bad_tool_calls, truncated, masked,
    test_edit_attempts, hack, reward_mean and pass_rate, solved_tested_first (the share of
    passed episodes that ran the tests before finishing; 0 with none passed), lookup_flags (tool calls that went
    looking for the deleted code, total and per kind: rollouts.agent.monitor), over the
    episodes. Where some episodes started after scripted calls (`info["prefix_calls"]`; their
    turns and tool calls count those calls): prefix_fraction, prefix_calls_mean (over those
    episodes), and reward_mean and pass_rate split into `_from_start` and `_from_prefix`. With
    `tasks` (each episode's): pass_rate/FAMILY for each `metadata["family"]` among them (the
    embedded family's templates), which tells a template the policy learns from one whose share
    of the draw rose. test_runs_cached: the share of `run_tests` calls read from a run cache."""
    if not trajs:
        return {}
    n = len(trajs)
    solved = [t for t in trajs if t.info.get("passed")]
    calls: Counter[str] = Counter()
    lookups: Counter[str] = Counter()
    for t in trajs:
        calls.update(t.info.get("tool_calls", {}))
        lookups.update(t.info.get("lookups", {}))
    out = {
        "agent/episodes": float(n),
        "agent/turns_mean": sum(t.info.get("turns", 0) for t in trajs) / n,
        "agent/tool_calls": float(sum(calls.values())),
        "agent/bad_tool_calls": float(sum(t.info.get("bad_tool_calls", 0) for t in trajs)),
        "agent/truncated": sum(bool(t.info.get("truncated")) for t in trajs) / n,
        "agent/masked": sum(bool(t.info.get("masked")) for t in trajs) / n,
        "agent/test_edit_attempts": float(sum(t.info.get("test_edit_attempts", 0) for t in trajs)),
        "agent/hack": sum(bool(t.info.get("hack")) for t in trajs) / n,
        "agent/reward_mean": sum(t.reward for t in trajs) / n,
        "agent/pass_rate": sum(bool(t.info.get("passed")) for t in trajs) / n,
        "agent/solved_tested_first": (sum(ran_tests_before_finish(t.info) for t in solved)
                                      / len(solved) if solved else 0.0),
        "agent/lookup_flags": float(sum(lookups.values())),
    }
    if calls["run_tests"]:  # the share read from a `RunCache` (agent.test_cache)
        out["agent/test_runs_cached"] = (sum(t.info.get("cached_test_runs", 0) for t in trajs)
                                         / calls["run_tests"])
    prefixed = [t for t in trajs if t.info.get("prefix_calls")]
    if prefixed:
        out["agent/prefix_fraction"] = len(prefixed) / n
        out["agent/prefix_calls_mean"] = sum(t.info["prefix_calls"] for t in prefixed) / len(prefixed)
        from_start = [t for t in trajs if not t.info.get("prefix_calls")]
        for where, group in (("from_start", from_start), ("from_prefix", prefixed)):
            if group:
                out[f"agent/reward_mean_{where}"] = sum(t.reward for t in group) / len(group)
                out[f"agent/pass_rate_{where}"] = sum(bool(t.info.get("passed"))
                                                      for t in group) / len(group)
    by_family: dict[str, list[bool]] = {}
    for t, task in zip(trajs, tasks or [None] * n, strict=True):
        if family := task and task.metadata.get("family"):
            by_family.setdefault(family, []).append(bool(t.info.get("passed")))
    out.update({f"agent/pass_rate/{f}": sum(p) / len(p) for f, p in sorted(by_family.items())})
    out.update({f"agent/tool_calls/{name}": float(k) for name, k in sorted(calls.items())})
    out.update({f"agent/lookup_flags/{kind}": float(k) for kind, k in sorted(lookups.items())})
    return out
