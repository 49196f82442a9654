from __future__ import annotations

import itertools

import pytest

from jaxagent.eval import mean_pass_at_k, pass_at_k


def _brute_force(n: int, c: int, k: int) -> float:
    """Share of all k-subsets of n samples (c correct) that contain a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_brute_force_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_force(n, c, k), abs=1e-12)


def test_large_n_is_exact_and_in_range():
    assert pass_at_k(200, 0, 100) == 0.0
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200)
    assert pass_at_k(200, 101, 100) == 1.0


@pytest.mark.parametrize(("n", "c", "k"), [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)])
def test_invalid_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_mean_over_tasks_skips_tasks_with_too_few_samples():
    results = [("a", True), ("a", False), ("b", False), ("b", False), ("c", True)]
    out = mean_pass_at_k(results, ks=[1, 2])
    assert out[1] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert out[2] == pytest.approx((1.0 + 0.0) / 2)
