"""pass@k: the unbiased estimator of Chen et al. (2021)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples, drawn without replacement from n with c correct, passes).

    1 - C(n-c, k) / C(n, k), computed with exact integers.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(
            f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}"
        )
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(
    results: Iterable[tuple[str, bool]], ks: Iterable[int]
) -> dict[int, float]:
    """Mean pass@k over tasks from (task_id, passed) samples; tasks with fewer than k samples are skipped."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for task_id, passed in results:
        counts[task_id][0] += 1
        counts[task_id][1] += bool(passed)
    out = {}
    for k in ks:
        scores = [pass_at_k(n, c, k) for n, c in counts.values() if n >= k]
        if scores:
            out[k] = sum(scores) / len(scores)
    return out
