"""Agent metrics over finished episodes (the `agent/...` scalars of the metrics log)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rollouts.environment import Trajectory


def agent_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """turns_mean, tool_calls (total and per tool), bad_tool_calls, truncated, masked,
    test_edit_attempts, hack, reward_mean and pass_rate, lookup_flags (tool calls that went
    looking for the deleted code, total and per kind: rollouts.agent.monitor), over the
    episodes."""
    if not trajs:
        return {}
    n = len(trajs)
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
        "agent/lookup_flags": float(sum(lookups.values())),
    }
    out.update({f"agent/tool_calls/{name}": float(k) for name, k in sorted(calls.items())})
    out.update({f"agent/lookup_flags/{kind}": float(k) for kind, k in sorted(lookups.items())})
    return out
