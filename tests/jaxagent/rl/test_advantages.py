"""jaxagent.rl.advantages against plain float64 NumPy references (loops on purpose)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.rl import (
    group_has_signal,
    grpo_advantages,
    masked_advantages,
    overlong_penalty,
    rloo_advantages,
    scale_negatives,
)

N, G = 5, 7  # groups, group size: distinct odd sizes so a transposed axis cannot pass


def make_rewards(seed=0):
    """Random rewards; group 1 is constant 0.1 (its sum does not round-trip), group 3 all ones."""
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(N, G))
    rewards[1] = 0.1
    rewards[3] = 1.0
    return rewards


def ref_grpo(rewards, normalize_std, eps):
    out = np.zeros_like(rewards)
    for i, group in enumerate(rewards):
        mean = sum(group) / len(group)
        std = (sum((r - mean) ** 2 for r in group) / len(group)) ** 0.5  # population, ddof=0
        for j, r in enumerate(group):
            if all(x == group[0] for x in group):
                out[i, j] = 0.0
            elif normalize_std:
                out[i, j] = (r - mean) / (std + eps)
            else:
                out[i, j] = r - mean
    return out


def ref_rloo(rewards):
    out = np.zeros_like(rewards)
    for i, group in enumerate(rewards):
        for j, r in enumerate(group):
            others = [x for k, x in enumerate(group) if k != j]
            out[i, j] = r - sum(others) / len(others)
    return out


def central_diff_grad(f, x, h=1e-6):
    """Gradient of the scalar f at x by central differences, float64."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (f(up) - f(down)) / (2 * h)
    return grad


@pytest.mark.parametrize("normalize_std", [True, False])
def test_grpo_matches_reference_values_and_gradient(normalize_std):
    rewards = make_rewards()
    weights = np.random.default_rng(1).normal(size=(N, G))
    expected = ref_grpo(rewards, normalize_std, 1e-6)
    with jax.enable_x64(True):
        got = grpo_advantages(jnp.asarray(rewards), normalize_std=normalize_std)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
        loss = lambda r: jnp.sum(weights * grpo_advantages(r, normalize_std=normalize_std))
        grad = jax.jit(jax.grad(loss))(jnp.asarray(rewards))
    # Constant groups are pinned to exactly 0, so their reference gradient is 0 too.
    live = [i for i in range(N) if i not in (1, 3)]
    expected_grad = np.zeros_like(rewards)
    expected_grad[live] = central_diff_grad(
        lambda r: np.sum(weights[live] * ref_grpo(r, normalize_std, 1e-6)), rewards[live])
    assert np.all(np.isfinite(grad))
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-6, atol=1e-7)
    # float32 (the trainer's default) agrees within float32 rounding.
    got32 = grpo_advantages(jnp.asarray(rewards, jnp.float32), normalize_std=normalize_std)
    np.testing.assert_allclose(got32, expected, rtol=1e-4, atol=1e-5)


def test_grpo_uses_population_std():
    # [0, 1]: mean 0.5, population std 0.5 -> +-1; the sample std (0.707) would give +-0.707.
    got = grpo_advantages(jnp.array([[0.0, 1.0]]), eps=0.0)
    np.testing.assert_allclose(got, [[-1.0, 1.0]], rtol=1e-6)
    # eps is added to the std, not to the variance.
    got = grpo_advantages(jnp.array([[0.0, 1.0]]), eps=0.5)
    np.testing.assert_allclose(got, [[-0.5, 0.5]], rtol=1e-6)


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grpo_zero_variance_group_is_exactly_zero_with_finite_gradient(normalize_std, dtype):
    rewards = jnp.asarray(make_rewards(), dtype)
    adv = grpo_advantages(rewards, normalize_std=normalize_std)
    assert adv.dtype == dtype
    assert np.all(np.asarray(adv[1], np.float32) == 0.0) and np.all(np.asarray(adv[3], np.float32) == 0.0)
    assert np.all(np.isfinite(np.asarray(adv, np.float32)))
    loss = lambda r: jnp.sum(grpo_advantages(r, normalize_std=normalize_std) ** 2).astype(jnp.float32)
    grad = jax.jit(jax.grad(loss))(rewards)
    assert np.all(np.isfinite(np.asarray(grad, np.float32)))
    # All groups constant: every advantage 0, no NaN anywhere.
    flat = jnp.ones((N, G), dtype)
    assert np.all(np.asarray(grpo_advantages(flat, normalize_std=normalize_std), np.float32) == 0.0)


def test_rloo_matches_reference_values_gradient_and_identity():
    rewards = make_rewards(2)
    weights = np.random.default_rng(3).normal(size=(N, G))
    with jax.enable_x64(True):
        got = rloo_advantages(jnp.asarray(rewards))
        np.testing.assert_allclose(got, ref_rloo(rewards), rtol=1e-12, atol=1e-12)
        # rloo_i = G / (G - 1) * (r_i - mean)
        centered = rewards - rewards.mean(axis=1, keepdims=True)
        np.testing.assert_allclose(got, G / (G - 1) * centered, rtol=1e-12, atol=1e-12)
        # Constant groups: exactly 0, like GRPO (the identity above leaves ~1e-17 there).
        assert np.all(np.asarray(got)[[1, 3]] == 0.0)
        grad = jax.jit(jax.grad(lambda r: jnp.sum(weights * rloo_advantages(r))))(jnp.asarray(rewards))
    live = [0, 2, 4]
    expected_grad = np.zeros_like(rewards)
    expected_grad[live] = central_diff_grad(lambda r: np.sum(weights[live] * ref_rloo(r)), rewards[live])
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-6, atol=1e-7)


def test_rloo_needs_two_samples_per_group():
    with pytest.raises(ValueError, match="G >= 2"):
        rloo_advantages(jnp.zeros((N, 1)))
    with pytest.raises(ValueError, match="G >= 2"):
        jax.jit(rloo_advantages)(jnp.zeros((N, 1)))
    np.testing.assert_allclose(rloo_advantages(jnp.array([[1.0, 3.0]])), [[-2.0, 2.0]])


def test_group_has_signal():
    rewards = make_rewards(4)
    rewards[0] = [0.0] * (G - 1) + [1.0]  # one pass out of G: has signal
    rewards[2] = 0.5 + np.arange(G) * 1e-9  # std ~2e-9 < eps: float noise, no signal
    expected = [np.std(group) > 1e-6 for group in rewards]  # np.std is ddof=0
    assert expected == [True, False, False, False, True]
    got = group_has_signal(jnp.asarray(rewards, jnp.float32))
    assert got.dtype == jnp.bool_ and got.shape == (N,)
    assert list(np.asarray(got)) == expected
    # With a tiny eps the noise group counts (in float64, where its rewards still differ), but a
    # constant group never does, although its float std can come out a few ulps above 0.
    with jax.enable_x64(True):
        got = group_has_signal(jnp.asarray(rewards), eps=1e-300)
    assert list(np.asarray(got)) == [True, False, True, False, True]


def ref_overlong(length, max_len, buffer_len, penalty):
    if length <= max_len - buffer_len:
        return 0.0
    if length <= max_len:
        return penalty * ((max_len - buffer_len) - length) / buffer_len
    return -penalty


@pytest.mark.parametrize("max_len,buffer_len,penalty", [(20, 7, 1.0), (13, 13, 0.5), (9, 1, 2.0)])
def test_overlong_penalty_matches_reference(max_len, buffer_len, penalty):
    lengths = np.arange(0, max_len + 4)
    expected = [ref_overlong(int(n), max_len, buffer_len, penalty) for n in lengths]
    got = overlong_penalty(jnp.asarray(lengths, jnp.int32), max_len=max_len, buffer_len=buffer_len,
                           penalty=penalty)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_overlong_penalty_known_values_and_errors():
    got = overlong_penalty(jnp.array([[0, 6], [7, 8], [9, 10], [11, 50]]), max_len=10, buffer_len=4)
    np.testing.assert_allclose(got, [[0, 0], [-0.25, -0.5], [-0.75, -1], [-1, -1]])
    for bad in (0, -1, 11):
        with pytest.raises(ValueError, match="buffer_len"):
            overlong_penalty(jnp.array([3]), max_len=10, buffer_len=bad)


def test_advantage_functions_jit():
    rewards = jnp.asarray(make_rewards(5), jnp.float32)
    for fn in (lambda r: grpo_advantages(r, normalize_std=True),
               lambda r: grpo_advantages(r, normalize_std=False, eps=1e-3),
               rloo_advantages,
               lambda r: group_has_signal(r, eps=1e-6)):
        np.testing.assert_allclose(jax.jit(fn)(rewards), fn(rewards), rtol=1e-6, atol=1e-6)
    lengths = jnp.arange(30)
    fn = lambda n: overlong_penalty(n, max_len=25, buffer_len=10, penalty=0.7)
    np.testing.assert_allclose(jax.jit(fn)(lengths), fn(lengths), rtol=1e-6, atol=1e-7)


def _masked_reference(rewards, valid, baseline, normalize_std, eps=1e-6):
    """One group at a time over its valid members, in float64."""
    out = np.zeros_like(rewards, dtype=np.float64)
    for i, (r, v) in enumerate(zip(rewards.astype(np.float64), valid.astype(bool), strict=True)):
        if v.sum() < 2 or np.all(r[v] == r[v][0]):
            continue
        if baseline == "mean":
            adv = r[v] - r[v].mean()
        else:
            adv = r[v] - (r[v].sum() - r[v]) / (v.sum() - 1)
        out[i, v] = adv / (r[v].std() + eps) if normalize_std else adv
    return out


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_masked_advantages_match_a_float64_reference(baseline, normalize_std):
    rng = np.random.default_rng(7)
    rewards = rng.normal(size=(5, 7)).astype(np.float32)
    valid = rng.random((5, 7)) < 0.6
    valid[0] = True  # one full group, one with a single valid member, one all-equal group
    valid[1] = False
    valid[1, 3] = True
    rewards[2] = 0.5
    rewards[~valid] = np.nan  # masked-out episodes may carry anything
    got = masked_advantages(rewards, valid, baseline=baseline, normalize_std=normalize_std)
    np.testing.assert_allclose(got, _masked_reference(rewards, valid, baseline, normalize_std),
                               atol=1e-5)
    assert np.all(np.asarray(got)[~valid] == 0.0) and not np.any(np.asarray(got)[1:3])
    full = rng.normal(size=(3, 5)).astype(np.float32)
    if baseline == "mean":
        unmasked = grpo_advantages(full, normalize_std=normalize_std)
    else:
        unmasked = rloo_advantages(full) / (full.std(-1, keepdims=True) + 1e-6 if normalize_std
                                            else 1.0)
    np.testing.assert_allclose(masked_advantages(full, np.ones((3, 5)), baseline=baseline,
                                                 normalize_std=normalize_std), unmasked, atol=1e-5)
    grad = jax.grad(lambda r: jnp.sum(masked_advantages(
        r, valid, baseline=baseline, normalize_std=normalize_std) ** 2))(jnp.nan_to_num(rewards))
    assert np.all(np.isfinite(grad))


@pytest.mark.parametrize("seed", range(4))
def test_masked_advantages_and_signal_on_random_batches(seed):
    """Random sizes, rewards (0/1 passes, ties, fractions) and masks against the loop."""
    rng = np.random.default_rng(seed)
    n, g = rng.integers(1, 9), rng.integers(2, 9)
    rewards = rng.choice([0.0, 0.25, 1.0], size=(n, g)) + (rng.random((n, g)) < 0.3) * rng.normal(
        size=(n, g))
    valid = rng.random((n, g)) < 0.7
    for baseline in ("mean", "leave_one_out"):
        for normalize_std in (True, False):
            got = masked_advantages(jnp.asarray(rewards, jnp.float32), valid, baseline=baseline,
                                    normalize_std=normalize_std)
            want = _masked_reference(rewards.astype(np.float32), valid, baseline, normalize_std)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    signal = [v.sum() >= 2 and np.std(r[v]) > 1e-6 for r, v in zip(rewards, valid, strict=True)]
    got = group_has_signal(jnp.asarray(rewards, jnp.float32), valid)
    assert np.asarray(got).tolist() == signal


def test_masked_advantages_rejects_an_unknown_baseline():
    with pytest.raises(ValueError, match="baseline"):
        masked_advantages(jnp.zeros((2, 3)), np.ones((2, 3)), baseline="median")


def test_scale_negatives_against_a_loop():
    rng = np.random.default_rng(11)
    adv = rng.normal(size=(N, G)).astype(np.float32)
    adv[2, :3] = 0.0
    for scale in (0.0, 0.25, 1.0, 2.0):
        want = np.array([[a * scale if a < 0 else a for a in row] for row in adv.tolist()])
        got = jax.jit(scale_negatives)(adv, scale)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.array_equal(scale_negatives(adv, 1.0), adv)
