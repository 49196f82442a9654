"""jaxagent.rl.losses against plain float64 NumPy references (loops on purpose).

Gradients are compared with the analytic gradient written out in the reference, which is
itself checked against central finite differences once.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.rl import (
    AGGREGATIONS,
    aggregate,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    token_logprobs,
    token_logprobs_and_entropy,
    truncated_importance_weights,
)

B, T, V = 9, 13, 11  # sequences, time, vocabulary: distinct odd sizes
EMPTY_ROW = 2  # fully masked in make_batch


def make_batch(seed=0):
    """Random float64 batch: ratios spread around 1 so some tokens clip, row 2 fully masked,
    row 5 with zero advantage (a zero-variance group), responses at random offsets."""
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.05, 3.0, size=(B, T))
    new = old + rng.normal(0.0, 0.25, size=(B, T))
    adv = rng.normal(size=B)
    adv[5] = 0.0
    mask = np.zeros((B, T), bool)
    for b in range(B):
        start = rng.integers(0, 4)
        mask[b, start:start + rng.integers(1, T - start + 1)] = True
    mask[EMPTY_ROW] = False
    weights = rng.uniform(0.3, 2.0, size=(B, T))
    return new, old, adv, mask, weights


def ref_coefficients(mask, aggregation, norm_length):
    """Weight of each token in the aggregate: loss = sum_bt coef_bt * x_bt."""
    coef = np.zeros(mask.shape)
    total = mask.sum()
    nonempty = sum(1 for row in mask if row.any())
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                continue
            if aggregation == "token-mean":
                coef[b, t] = 1.0 / total
            elif aggregation == "seq-mean-token-mean":
                coef[b, t] = 1.0 / (mask[b].sum() * nonempty)
            else:
                coef[b, t] = 1.0 / (mask.shape[0] * norm_length)
    return coef


def ref_policy_loss(new, old, adv, mask, clip_low, clip_high, aggregation, norm_length, weights=None,
                    clip_ratio_c=None):
    """Returns loss, d loss / d new (analytic), metrics, and the clipped-token map."""
    coef = ref_coefficients(mask, aggregation, norm_length)
    loss, grad = 0.0, np.zeros(new.shape)
    clipped_map = np.zeros(new.shape, bool)
    dual_map = np.zeros(new.shape, bool)
    ratios, kls = [], []
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            if not mask[b, t]:
                continue
            rho = math.exp(new[b, t] - old[b, t])
            w = 1.0 if weights is None else weights[b, t]
            unclipped = rho * adv[b]
            clipped = min(max(rho, 1 - clip_low), 1 + clip_high) * adv[b]
            surrogate = min(unclipped, clipped)
            # dual-clip: a negative advantage's surrogate is at least c A (a constant)
            dual_map[b, t] = clip_ratio_c is not None and adv[b] < 0 and surrogate < clip_ratio_c * adv[b]
            if dual_map[b, t]:
                surrogate = clip_ratio_c * adv[b]
            loss += coef[b, t] * -w * surrogate
            clipped_map[b, t] = clipped < unclipped
            # The clipped term is constant in new when active; otherwise d(rho A)/d new = rho A.
            constant = clipped_map[b, t] or dual_map[b, t]
            grad[b, t] = 0.0 if constant else coef[b, t] * -w * adv[b] * rho
            ratios.append(rho)
            kls.append(old[b, t] - new[b, t])
    n = max(len(ratios), 1)
    metrics = {"clip_fraction": clipped_map.sum() / n, "ratio_mean": sum(ratios) / n,
               "ratio_max": max(ratios, default=0.0), "approx_kl": sum(kls) / n,
               "dual_clip_fraction": dual_map.sum() / n}
    return loss, grad, metrics, clipped_map


@functools.cache
def _compiled_loss_and_grad(options):
    def loss(new, old, adv, mask, weights):
        return policy_loss(new, old, adv, mask, importance_weights=weights, **dict(options))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 4), has_aux=True))


def jax_loss_and_grad(new, old, adv, mask, weights=None, **options):
    """policy_loss and its gradient w.r.t. logprobs, jitted (one compile per option set).

    Also checks that no gradient flows into old_logprobs, advantages or the weights.
    """
    fn = _compiled_loss_and_grad(tuple(sorted(options.items())))
    args = tuple(jnp.asarray(x) for x in (new, old, adv, mask))
    (loss, metrics), (grad, *constant_grads) = fn(*args, None if weights is None else jnp.asarray(weights))
    for g in jax.tree.leaves(constant_grads):
        assert np.all(np.asarray(g) == 0.0)
    return loss, grad, metrics


def test_reference_gradient_matches_finite_differences():
    new, old, adv, mask, weights = make_batch(1)
    args = (old, adv, mask, 0.1, 0.3, "seq-mean-token-mean", None, weights)
    _, grad, _, clipped = ref_policy_loss(new, *args)
    assert clipped.any() and (mask & ~clipped).any()
    fd = np.zeros_like(new)
    h = 1e-6
    for idx in np.ndindex(new.shape):
        up, down = new.copy(), new.copy()
        up[idx] += h
        down[idx] -= h
        fd[idx] = (ref_policy_loss(up, *args)[0] - ref_policy_loss(down, *args)[0]) / (2 * h)
    np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("with_weights", [False, True])
def test_policy_loss_matches_reference(aggregation, with_weights):
    new, old, adv, mask, weights = make_batch(2)
    weights = weights if with_weights else None
    options = {"clip_low": 0.2, "clip_high": 0.28, "aggregation": aggregation, "norm_length": 17}
    want_loss, want_grad, want_metrics, clipped = ref_policy_loss(
        new, old, adv, mask, 0.2, 0.28, aggregation, 17, weights)
    assert 0 < clipped.sum() < mask.sum()  # the batch exercises both branches
    with jax.enable_x64(True):
        loss, grad, metrics = jax_loss_and_grad(new, old, adv, mask, weights, **options)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-15)
    assert sorted(metrics) == sorted(want_metrics)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-12, err_msg=key)
    if aggregation == "token-mean" and with_weights:
        # float32, the trainer's dtype: same within float32 rounding (one case: compiles cost).
        loss32, grad32, _ = jax_loss_and_grad(*(np.float32(x) for x in (new, old, adv)), mask,
                                              np.float32(weights), **options)
        assert loss32.dtype == jnp.float32
        np.testing.assert_allclose(loss32, want_loss, rtol=1e-5)
        np.testing.assert_allclose(grad32, want_grad, rtol=1e-4, atol=1e-7)


def test_asymmetric_clipping_clips_the_right_tokens():
    ratios = np.array([0.75, 0.85, 0.95, 1.25, 1.4])
    old = np.full((2, 5), -1.0)
    new = old + np.log(ratios)
    adv = np.array([1.5, -1.5])
    mask = np.ones((2, 5), bool)
    # clip_low=0.1, clip_high=0.3: A > 0 clips rho > 1.3 only; A < 0 clips rho < 0.9 only.
    loss, grad, metrics = jax_loss_and_grad(new, old, adv, mask, clip_low=0.1, clip_high=0.3)
    expected_clipped = np.array([[0, 0, 0, 0, 1], [1, 1, 0, 0, 0]], bool)
    want_loss, want_grad, _, clipped = ref_policy_loss(new, old, adv, mask, 0.1, 0.3, "token-mean", None)
    np.testing.assert_array_equal(clipped, expected_clipped)
    np.testing.assert_array_equal(np.asarray(grad) == 0, expected_clipped)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["clip_fraction"], 3 / 10)
    # Symmetric 0.2 clips a different set: rho > 1.2 for A > 0, rho < 0.8 for A < 0.
    _, grad, metrics = jax_loss_and_grad(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    np.testing.assert_array_equal(np.asarray(grad) == 0, [[0, 0, 0, 1, 1], [1, 0, 0, 0, 0]])
    np.testing.assert_allclose(metrics["clip_fraction"], 3 / 10)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_on_policy_gradient_is_reinforce(aggregation):
    """logp == old_logp: d loss / d theta = d/d theta aggregate(-A * logp), through a real
    log-softmax (theta = the logits). The same traced logp is passed as old_logprobs too:
    policy_loss must treat the old policy as a constant."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(B, T, V)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, size=(B, T)))
    _, _, adv, mask, _ = make_batch(3)
    adv, mask = jnp.asarray(adv, jnp.float32), jnp.asarray(mask)
    options = {"aggregation": aggregation, "norm_length": T}

    def ppo(theta):
        logp = token_logprobs(theta, tokens)
        loss, metrics = policy_loss(logp, logp, adv, mask, **options)
        return loss, metrics

    def reinforce(theta):
        return aggregate(-adv[:, None] * token_logprobs(theta, tokens), mask, **options)

    grad_ppo, metrics = jax.jit(jax.grad(ppo, has_aux=True))(logits)
    grad_reinforce = jax.jit(jax.grad(reinforce))(logits)
    assert float(jnp.abs(grad_reinforce).max()) > 1e-3
    np.testing.assert_allclose(grad_ppo, grad_reinforce, rtol=1e-5, atol=1e-8)
    assert metrics == {"clip_fraction": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0, "approx_kl": 0.0,
                       "dual_clip_fraction": 0.0}


def test_drgrpo_constant_normaliser():
    new, old, adv, mask, _ = make_batch(4)
    options = {"aggregation": "seq-mean-token-sum-norm"}
    loss7, grad7, _ = jax_loss_and_grad(new, old, adv, mask, norm_length=7, **options)
    loss50, grad50, _ = jax_loss_and_grad(new, old, adv, mask, norm_length=50, **options)
    np.testing.assert_allclose(loss7 * 7, loss50 * 50, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad7) * 7, np.asarray(grad50) * 50, rtol=1e-5, atol=1e-9)
    # On-policy, each token's gradient is -A_b / (B * norm_length) whatever the lengths.
    short = mask.copy()
    short[:, 6:] = False
    for m in (mask, short):
        _, grad, _ = jax_loss_and_grad(old, old, adv, m, norm_length=7, **options)
        want = np.where(m, -adv[:, None] / (B * 7), 0.0)
        np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-9)
    # token-mean, by contrast, reweights every token when the lengths change.
    _, long_grad, _ = jax_loss_and_grad(old, old, adv, mask)
    _, short_grad, _ = jax_loss_and_grad(old, old, adv, short)
    assert not np.allclose(np.asarray(long_grad)[short], np.asarray(short_grad)[short])
    with pytest.raises(ValueError, match="norm_length"):
        policy_loss(jnp.asarray(new), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), **options)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_all_masked_batch_is_zero_not_nan(aggregation):
    new, old, adv, _, weights = make_batch(5)
    mask = np.zeros((B, T), bool)
    loss, grad, metrics = jax_loss_and_grad(new, old, adv, mask, weights, aggregation=aggregation,
                                            norm_length=T)
    assert float(loss) == 0.0
    assert np.all(np.asarray(grad) == 0.0)
    assert {k: float(v) for k, v in metrics.items()} == {
        "clip_fraction": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0, "approx_kl": 0.0,
        "dual_clip_fraction": 0.0}


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_garbage_off_mask_never_reaches_loss_or_gradient(aggregation):
    new, old, adv, mask, weights = make_batch(6)
    clean = jax_loss_and_grad(new, old, adv, mask, weights, aggregation=aggregation, norm_length=T)
    dirty_new, dirty_old, dirty_w = new.copy(), old.copy(), weights.copy()
    dirty_new[~mask] = np.array([np.inf, -np.inf, np.nan, 1e30])[np.arange((~mask).sum()) % 4]
    dirty_old[~mask] = np.nan
    dirty_w[~mask] = np.inf
    dirty = jax_loss_and_grad(dirty_new, dirty_old, adv, mask.astype(np.float32), dirty_w,
                              aggregation=aggregation, norm_length=T)
    for c, d in zip(clean[:2], dirty[:2]):
        assert np.all(np.isfinite(d))
        np.testing.assert_array_equal(c, d)
    assert np.all(np.asarray(dirty[1])[~mask] == 0.0)
    for key in clean[2]:
        np.testing.assert_array_equal(clean[2][key], dirty[2][key], err_msg=key)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_aggregate_matches_reference(aggregation):
    rng = np.random.default_rng(7)
    values = rng.normal(size=(B, T))
    _, _, _, mask, _ = make_batch(7)
    want = np.sum(ref_coefficients(mask, aggregation, 19) * values)
    with jax.enable_x64(True):
        got = aggregate(jnp.asarray(values), jnp.asarray(mask), aggregation=aggregation, norm_length=19)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # The empty row really is excluded from the sequence count of seq-mean-token-mean.
    if aggregation == "seq-mean-token-mean":
        rows = [values[b][mask[b]].mean() for b in range(B) if mask[b].any()]
        np.testing.assert_allclose(got, np.mean(rows), rtol=1e-12)


def packed_rows(*arrays):
    """[B, T] arrays of make_batch's rows -> [4, 4T] packed rows of 3, 2, 4 and 0 sequences
    (segment ids 1, 2, ... per row, 0 on padding), and the segment ids."""
    layout = [[0, 1, 2], [3, 4], [5, 6, 7, 8], []]
    out = [np.zeros((len(layout), 4 * T), x.dtype) for x in arrays]
    segments = np.zeros((len(layout), 4 * T), np.int32)
    for r, rows in enumerate(layout):
        for k, b in enumerate(rows):
            cols = slice(k * T, (k + 1) * T)
            segments[r, cols] = k + 1
            for x, o in zip(arrays, out):
                o[r, cols] = x[b]
    return out, segments


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_aggregate_over_packed_sequences_matches_reference(aggregation):
    """Rows holding several sequences (`segments`): the aggregate over the sequences, the
    padding and the empty row counting for nothing (Dr.GRPO: B sequences, not 4 rows)."""
    rng = np.random.default_rng(8)
    values = rng.normal(size=(B, T))
    _, _, _, mask, _ = make_batch(8)
    want = np.sum(ref_coefficients(mask, aggregation, 19) * values)
    (packed, packed_mask), segments = packed_rows(values, mask)
    with jax.enable_x64(True):
        got = aggregate(jnp.asarray(packed), jnp.asarray(packed_mask), aggregation=aggregation,
                        norm_length=19, segments=jnp.asarray(segments))
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_policy_loss_over_packed_sequences_matches_reference(aggregation):
    """Per-token advantages with `segments`: the row layout's loss, metrics and gradient."""
    new, old, adv, mask, weights = make_batch(9)
    loss, grad, metrics, _ = ref_policy_loss(new, old, adv, mask, 0.2, 0.28, aggregation, 17,
                                             weights)
    per_token = np.broadcast_to(adv[:, None], (B, T))
    (p_new, p_old, p_adv, p_mask, p_w), segments = packed_rows(new, old, per_token, mask, weights)
    with jax.enable_x64(True):
        (got, got_metrics), got_grad = jax.value_and_grad(
            lambda x: policy_loss(x, jnp.asarray(p_old), jnp.asarray(p_adv), jnp.asarray(p_mask),
                                  clip_low=0.2, clip_high=0.28, aggregation=aggregation,
                                  norm_length=17, importance_weights=jnp.asarray(p_w),
                                  segments=jnp.asarray(segments)), has_aux=True)(
            jnp.asarray(p_new))
    np.testing.assert_allclose(got, loss, rtol=1e-12)
    for key, value in metrics.items():
        np.testing.assert_allclose(got_metrics[key], value, rtol=1e-12, err_msg=key)
    (want_grad,), _ = packed_rows(grad)
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-10, atol=1e-15)


def test_option_names_are_validated():
    x, m = jnp.zeros((B, T)), jnp.ones((B, T))
    with pytest.raises(ValueError, match=r"aggregation must be one of .*token-mean.*'seq-mean'"):
        aggregate(x, m, aggregation="seq-mean")
    with pytest.raises(ValueError, match="aggregation.*'sum'"):
        policy_loss(x, x, jnp.zeros(B), m, aggregation="sum")
    with pytest.raises(ValueError, match=r"estimator must be one of \('k1', 'k2', 'k3'\), got 'k4'"):
        kl_penalty(x, x, estimator="k4")
    with pytest.raises(ValueError, match=r"advantages must be \[B\]"):
        policy_loss(x, x, jnp.zeros((B, 1)), m)
    with pytest.raises(ValueError, match="norm_length must be positive"):
        aggregate(x, m, aggregation="seq-mean-token-sum-norm", norm_length=0)


def test_kl_estimators_known_values():
    # pi = 0.5, ref = 0.25 at the sampled token: log pi - log ref = log 2.
    logp, ref = jnp.log(jnp.array([[0.5]])), jnp.log(jnp.array([[0.25]]))
    np.testing.assert_allclose(kl_penalty(logp, ref, estimator="k1"), [[math.log(2)]], rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(logp, ref, estimator="k2"), [[0.5 * math.log(2) ** 2]], rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(logp, ref, estimator="k3"), [[0.5 - 1 + math.log(2)]], rtol=1e-6)
    np.testing.assert_allclose(kl_penalty(logp, ref), kl_penalty(logp, ref, estimator="k3"))  # default


def test_kl_estimators_match_reference_values_and_gradients():
    rng = np.random.default_rng(8)
    logp = -rng.uniform(0.01, 4, size=(B, T))
    ref = logp + rng.normal(0, 1.0, size=(B, T))
    ref[0, :5] = logp[0, :5] + np.array([0.0, 1e-8, -1e-8, 1e-4, -1e-4])  # near-equal policies
    refs = {"k1": (lambda a, r: a - r, lambda a, r: 1.0),
            "k2": (lambda a, r: 0.5 * (a - r) ** 2, lambda a, r: a - r),
            "k3": (lambda a, r: math.exp(r - a) - 1 - (r - a), lambda a, r: 1 - math.exp(r - a))}
    for name, (value_fn, grad_fn) in refs.items():
        want = np.array([[value_fn(a, r) for a, r in zip(ra, rr)] for ra, rr in zip(logp, ref)])
        want_grad = np.array([[grad_fn(a, r) for a, r in zip(ra, rr)] for ra, rr in zip(logp, ref)])
        kl = functools.partial(kl_penalty, estimator=name)
        with jax.enable_x64(True):
            got = jax.jit(kl)(jnp.asarray(logp), jnp.asarray(ref))
            total = lambda a, r, kl=kl: jnp.sum(kl(a, r))
            grad, ref_grad = jax.jit(jax.grad(total, argnums=(0, 1)))(jnp.asarray(logp), jnp.asarray(ref))
        assert np.all(np.asarray(ref_grad) == 0.0)  # the reference model is frozen
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15, err_msg=name)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-7, atol=1e-15, err_msg=name)
        got32 = kl_penalty(jnp.asarray(logp, jnp.float32), jnp.asarray(ref, jnp.float32), estimator=name)
        np.testing.assert_allclose(got32, want, rtol=1e-4, atol=1e-6, err_msg=name)
        if name != "k1":
            assert np.all(np.asarray(got32) >= 0) and np.all(np.asarray(got) >= 0)


def test_k1_and_k3_are_unbiased_for_the_exact_kl():
    """Expectation over the sampled token v ~ pi: sum_v pi_v k(v) = KL(pi || ref) for k1 and k3."""
    rng = np.random.default_rng(9)
    logits_pi, logits_ref = rng.normal(size=(2, V)), rng.normal(size=(2, V))
    log_pi = logits_pi - np.log(np.exp(logits_pi).sum(-1, keepdims=True))
    log_ref = logits_ref - np.log(np.exp(logits_ref).sum(-1, keepdims=True))
    exact = np.sum(np.exp(log_pi) * (log_pi - log_ref), axis=-1)
    with jax.enable_x64(True):
        for name in ("k1", "k3"):
            k = kl_penalty(jnp.asarray(log_pi), jnp.asarray(log_ref), estimator=name)
            np.testing.assert_allclose(np.sum(np.exp(log_pi) * np.asarray(k), axis=-1), exact, rtol=1e-10)


def ref_log_softmax(row):
    top = max(row)
    lse = top + math.log(sum(math.exp(z - top) for z in row))
    return np.array([z - lse for z in row])


def test_token_logprobs_matches_reference_values_and_gradient():
    rng = np.random.default_rng(10)
    logits = rng.normal(0, 3, size=(B, T, V))
    tokens = rng.integers(0, V, size=(B, T))
    upstream = rng.normal(size=(B, T))
    want = np.zeros((B, T))
    want_grad = np.zeros((B, T, V))
    for b in range(B):
        for t in range(T):
            logp = ref_log_softmax(logits[b, t])
            want[b, t] = logp[tokens[b, t]]
            # d logp_v / d z = onehot(v) - softmax(z)
            want_grad[b, t] = upstream[b, t] * (np.eye(V)[tokens[b, t]] - np.exp(logp))
    with jax.enable_x64(True):
        got = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens))
        grad = jax.jit(jax.grad(lambda z: jnp.sum(upstream * token_logprobs(z, jnp.asarray(tokens)))))(
            jnp.asarray(logits))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-14)
    # float32 and bfloat16 logits give float32 log-probs.
    for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)):
        got = token_logprobs(jnp.asarray(logits, dtype), jnp.asarray(tokens))
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


def test_token_logprobs_and_entropy_are_stable_for_large_logits():
    rng = np.random.default_rng(11)
    logits = (rng.normal(0, 50, size=(B, T, V)) + 1000).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, T))
    want = np.array([[ref_log_softmax(logits[b, t].astype(np.float64))[tokens[b, t]] for t in range(T)]
                     for b in range(B)])
    got = token_logprobs(jnp.asarray(logits), jnp.asarray(tokens))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)
    entropy = entropy_from_logits(jnp.asarray(logits), jnp.ones((B, T)))
    assert np.isfinite(float(entropy)) and float(entropy) >= 0


def test_entropy_matches_reference_values_and_gradient():
    rng = np.random.default_rng(12)
    logits = rng.normal(0, 2, size=(B, T, V))
    _, _, _, mask, _ = make_batch(12)
    total = mask.sum()
    want, want_grad = 0.0, np.zeros((B, T, V))
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            logp = ref_log_softmax(logits[b, t])
            h = -sum(math.exp(lp) * lp for lp in logp)
            want += h / total
            # dH/dz_v = -p_v (log p_v + H)
            want_grad[b, t] = -np.exp(logp) * (logp + h) / total
    with jax.enable_x64(True):
        got = entropy_from_logits(jnp.asarray(logits), jnp.asarray(mask))
        grad = jax.jit(jax.grad(entropy_from_logits))(jnp.asarray(logits), jnp.asarray(mask))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-14)
    got32 = entropy_from_logits(jnp.asarray(logits, jnp.float32), jnp.asarray(mask))
    np.testing.assert_allclose(got32, want, rtol=1e-5)
    assert float(entropy_from_logits(jnp.asarray(logits), jnp.zeros((B, T)))) == 0.0


def test_joint_logprobs_and_entropy_match_reference_values_and_gradient():
    """Both outputs of the shared pass, and a gradient through both at once."""
    rng = np.random.default_rng(15)
    logits = rng.normal(0, 2, size=(B, T, V))
    tokens = rng.integers(0, V, size=(B, T))
    up_logp, up_h = rng.normal(size=(B, T)), rng.normal(size=(B, T))
    want_logp, want_h, want_grad = np.zeros((B, T)), np.zeros((B, T)), np.zeros((B, T, V))
    for b in range(B):
        for t in range(T):
            logp = ref_log_softmax(logits[b, t])
            p, h = np.exp(logp), -sum(math.exp(lp) * lp for lp in logp)
            want_logp[b, t], want_h[b, t] = logp[tokens[b, t]], h
            want_grad[b, t] = (up_logp[b, t] * (np.eye(V)[tokens[b, t]] - p)
                               - up_h[b, t] * p * (logp + h))

    def objective(z):
        logp, h = token_logprobs_and_entropy(z, jnp.asarray(tokens))
        return jnp.sum(up_logp * logp) + jnp.sum(up_h * h)

    with jax.enable_x64(True):
        got_logp, got_h = token_logprobs_and_entropy(jnp.asarray(logits), jnp.asarray(tokens))
        grad = jax.jit(jax.grad(objective))(jnp.asarray(logits))
    np.testing.assert_allclose(got_logp, want_logp, rtol=1e-12)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-14)


def test_entropy_with_banned_tokens_has_no_nan():
    """-inf logits (banned tokens) have p log p = 0: the entropy is that of the other tokens."""
    rng = np.random.default_rng(13)
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    logits[..., :4] = -np.inf
    mask = jnp.ones((B, T))
    got, grad = jax.jit(jax.value_and_grad(entropy_from_logits))(jnp.asarray(logits), mask)
    want = entropy_from_logits(jnp.asarray(logits[..., 4:]), mask)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(grad)[..., :4] == 0.0)


def test_truncated_importance_weights():
    rng = np.random.default_rng(14)
    behaviour = -rng.uniform(0.1, 3, size=(B, T))
    proximal = behaviour + rng.normal(0, 0.8, size=(B, T))
    proximal[0, 0] = behaviour[0, 0] + 1000.0  # would overflow exp

    def ref(cap):
        return np.array([[cap if p - q > math.log(cap) else math.exp(p - q) for p, q in zip(rp, rq)]
                         for rp, rq in zip(proximal, behaviour)])

    want = ref(1.5)
    assert (want == 1.5).sum() > 1 and (want < 1.5).sum() > B  # both regimes present
    with jax.enable_x64(True):
        got = truncated_importance_weights(jnp.asarray(proximal), jnp.asarray(behaviour), cap=1.5)
        np.testing.assert_allclose(got, want, rtol=1e-12)
    got32 = truncated_importance_weights(jnp.asarray(proximal, jnp.float32),
                                         jnp.asarray(behaviour, jnp.float32))
    assert np.all(np.isfinite(np.asarray(got32)))
    np.testing.assert_allclose(got32, ref(2.0), rtol=1e-5)  # default cap
    # No gradient flows through the weights, to either argument.
    grads = jax.grad(lambda p, q: jnp.sum(truncated_importance_weights(p, q) * 3.0), argnums=(0, 1))(
        jnp.asarray(proximal, jnp.float32), jnp.asarray(behaviour, jnp.float32))
    assert all(np.all(np.asarray(g) == 0.0) for g in grads)


def test_loss_functions_jit():
    """Each function under jax.jit equals its eager self. (policy_loss, kl_penalty and the
    gradients are jitted in the reference tests above.)"""
    new, old, _, mask, _ = (x if x.dtype == bool else np.float32(x) for x in make_batch(15))
    rng = np.random.default_rng(15)
    logits = rng.normal(size=(B, T, V)).astype(np.float32)
    tokens = rng.integers(0, V, size=(B, T))
    calls = [
        (functools.partial(aggregate, aggregation="seq-mean-token-sum-norm", norm_length=T), (new, mask)),
        (functools.partial(kl_penalty, estimator="k2"), (new, old)),
        (token_logprobs, (logits, tokens)),
        (entropy_from_logits, (logits, mask)),
        (functools.partial(truncated_importance_weights, cap=1.3), (new, old)),
    ]
    for fn, args in calls:
        args = tuple(jnp.asarray(a) for a in args)
        np.testing.assert_allclose(jax.jit(fn)(*args), fn(*args), rtol=1e-6, atol=1e-6)


def test_dual_clip_matches_reference_and_bounds_stale_negative_tokens():
    """Ratios far from 1 (stale rollouts): dual-clip at c = 3 caps each negative-advantage
    token's loss at 3 |A| and takes its gradient away; positive advantages are untouched."""
    new, old, adv, mask, weights = make_batch(4)
    new = old + np.random.default_rng(9).normal(0.0, 1.5, size=new.shape)  # ratios up to ~e^4
    options = {"clip_low": 0.2, "clip_high": 0.2, "aggregation": "token-mean", "clip_ratio_c": 3.0}
    want_loss, want_grad, want_metrics, _ = ref_policy_loss(
        new, old, adv, mask, 0.2, 0.2, "token-mean", None, weights, clip_ratio_c=3.0)
    assert 0 < want_metrics["dual_clip_fraction"] < 0.5
    with jax.enable_x64(True):
        loss, grad, metrics = jax_loss_and_grad(new, old, adv, mask, weights, **options)
        plain, _, _ = jax_loss_and_grad(new, old, adv, mask, weights, clip_low=0.2, clip_high=0.2)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-15)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-12, err_msg=key)
    assert float(loss) < float(plain)  # the bound only ever lowers the loss
    # the example: ratio 7.4, advantage -0.52 -> 3.85 without, 1.56 with c = 3
    one = lambda **o: float(policy_loss(jnp.log(jnp.asarray([[7.4]])), jnp.zeros((1, 1)),
                                        jnp.asarray([-0.52]), jnp.ones((1, 1), bool), **o)[0])
    assert one() == pytest.approx(7.4 * 0.52, rel=1e-5)
    assert one(clip_ratio_c=3.0) == pytest.approx(3 * 0.52, rel=1e-6)
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        one(clip_ratio_c=0.5)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_clamp_bounds_each_token(estimator):
    rng = np.random.default_rng(3)
    logp = -rng.uniform(0.1, 3.0, (B, T))
    ref = logp + rng.normal(0, 8.0, (B, T))  # log-ratios up to ~25: k3 ~ 1e10
    d = ref - logp
    want = {"k1": -d, "k2": 0.5 * d * d, "k3": np.expm1(d) - d}[estimator]
    with jax.enable_x64(True):
        got = np.asarray(kl_penalty(jnp.asarray(logp), jnp.asarray(ref), estimator=estimator,
                                    clamp=10.0))
        g = np.asarray(jax.grad(lambda x: kl_penalty(x, jnp.asarray(ref), estimator=estimator,
                                                     clamp=10.0).sum())(jnp.asarray(logp)))
    np.testing.assert_allclose(got, np.clip(want, -10, 10), rtol=1e-12)
    dwant = {"k1": np.ones_like(d), "k2": -d, "k3": 1 - np.exp(d)}[estimator]  # d/dlogp
    np.testing.assert_allclose(g, np.where(np.abs(want) < 10, dwant, 0.0), rtol=1e-10)
    assert (np.abs(want) > 10).any()
