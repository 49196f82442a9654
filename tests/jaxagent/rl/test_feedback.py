"""The targeted-feedback loss: beta * KL(teacher || student) at flagged tokens only."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxagent.rl.feedback import allowed_kl, feedback_loss, target_kl, token_kl


def kl_reference(teacher, student):
    """float64 NumPy KL(softmax(teacher) || softmax(student)) per position."""
    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    t, s = log_softmax(teacher), log_softmax(student)
    return (np.exp(t) * (t - s)).sum(-1)


def test_hand_computed_kl():
    # teacher p = (1/4, 3/4), student q = (1/2, 1/2):
    # KL = 1/4 ln((1/4)/(1/2)) + 3/4 ln((3/4)/(1/2)) = -ln(2)/4 + 3/4 ln(3/2)
    teacher = jnp.array([[[0.0, math.log(3.0)]]])
    student = jnp.array([[[5.0, 5.0]]])
    expected = -math.log(2) / 4 + 0.75 * math.log(1.5)
    assert abs(expected - 0.130812035) < 1e-8
    np.testing.assert_allclose(token_kl(teacher, student), [[expected]], rtol=1e-6)
    mask = jnp.ones((1, 1))
    loss = feedback_loss(token_kl(teacher, student, mask), mask, beta=0.5)
    np.testing.assert_allclose(loss, 0.5 * expected, rtol=1e-6)


def test_matches_float64_reference_on_random_logits():
    b, t, v = 3, 5, 7
    kt, ks, km = jax.random.split(jax.random.key(11), 3)
    teacher = 2.0 * jax.random.normal(kt, (b, t, v))
    student = 2.0 * jax.random.normal(ks, (b, t, v))
    mask = jax.random.bernoulli(km, 0.5, (b, t)).astype(jnp.int32)
    ref = kl_reference(teacher, student)
    np.testing.assert_allclose(token_kl(teacher, student), ref, rtol=1e-5, atol=1e-6)
    m = np.asarray(mask, bool)
    expected = 0.3 * ref[m].sum() / m.sum()
    kl = token_kl(teacher, student, mask)
    np.testing.assert_allclose(kl, np.where(m, ref, 0.0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(feedback_loss(kl, mask, beta=0.3), expected, rtol=1e-5)
    per_seq = feedback_loss(kl, mask, beta=1.0, aggregation="seq-mean-token-mean")
    rows = [ref[i][m[i]].mean() for i in range(b) if m[i].any()]
    np.testing.assert_allclose(per_seq, np.mean(rows), rtol=1e-5)


def test_zero_where_no_detector_fires_even_with_garbage_logits():
    teacher = jnp.full((2, 3, 5), jnp.nan)
    student = jnp.zeros((2, 3, 5))
    none, every = jnp.zeros((2, 3)), jnp.ones((2, 3))

    def loss(t, s, mask):
        return feedback_loss(token_kl(t, s, mask), mask, beta=1.0)

    assert float(loss(teacher, student, none)) == 0.0
    grad = jax.grad(lambda s: loss(teacher, s, none))(student)
    assert not np.any(np.asarray(grad))
    same = jax.random.normal(jax.random.key(0), (2, 3, 5))
    np.testing.assert_allclose(loss(same, same, every), 0.0, atol=1e-7)


def test_gradient_reaches_only_the_student():
    kt, ks = jax.random.split(jax.random.key(3))
    teacher = jax.random.normal(kt, (1, 3, 7))
    student = jax.random.normal(ks, (1, 3, 7))
    mask = jnp.array([[1, 0, 1]])
    g_teacher, g_student = jax.grad(
        lambda t, s: feedback_loss(token_kl(t, s, mask), mask, beta=0.7),
        argnums=(0, 1))(teacher, student)
    assert not np.any(np.asarray(g_teacher))
    # d/ds KL(p || softmax(s)) = softmax(s) - p, averaged over the 2 masked tokens, times beta
    expected = 0.7 * (jax.nn.softmax(student) - jax.nn.softmax(teacher)) / 2 * mask[..., None]
    np.testing.assert_allclose(g_student, expected, atol=1e-6)


def test_scripted_teachers_kl_is_the_float64_negative_log_likelihood_of_its_tokens():
    """KL(point mass at y || softmax(s)) = -log softmax(s)[y], against float64 NumPy; a
    teacher whose logits all but put the mass on y gives the same per-position value."""
    b, t, v = 3, 5, 7
    ks, ky, km = jax.random.split(jax.random.key(12), 3)
    student = 2.0 * jax.random.normal(ks, (b, t, v))
    targets = jax.random.randint(ky, (b, t), 0, v)
    s = np.asarray(student, np.float64)
    s = s - s.max(-1, keepdims=True)
    log_q = s - np.log(np.exp(s).sum(-1, keepdims=True))
    ref = -np.take_along_axis(log_q, np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(target_kl(targets, student), ref, rtol=1e-5, atol=1e-6)
    peaked = 60.0 * jax.nn.one_hot(targets, v)
    np.testing.assert_allclose(token_kl(peaked, student), ref, rtol=1e-4, atol=1e-5)
    mask = jax.random.bernoulli(km, 0.5, (b, t)).astype(jnp.float32)
    m = np.asarray(mask, bool)
    np.testing.assert_allclose(target_kl(targets, student, mask), np.where(m, ref, 0.0),
                               rtol=1e-5, atol=1e-6)
    garbage = jnp.where(mask[..., None] != 0, student, jnp.nan)
    grad = jax.grad(lambda x: feedback_loss(target_kl(targets, x, mask), mask, beta=1.0))(garbage)
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(feedback_loss(target_kl(targets, student, mask), mask, beta=0.3),
                               0.3 * ref[m].mean(), rtol=1e-5)


def test_grammar_teachers_kl_is_minus_log_the_allowed_mass_in_float64():
    """KL(q restricted to the allowed tokens and renormalised || q), computed from its
    definition in float64, equals -log q(allowed); its gradient is q - p (the teacher p under
    stop_gradient); 0 with no gradient off the mask, even over garbage logits."""
    b, t, v = 3, 5, 7
    ks, ka, km = jax.random.split(jax.random.key(13), 3)
    student = 2.0 * jax.random.normal(ks, (b, t, v))
    allowed = jax.random.bernoulli(ka, 0.4, (b, t, v)).at[..., 2].set(True)  # none empty
    s = np.asarray(student, np.float64)
    q = np.exp(s - s.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    a = np.asarray(allowed)
    p = np.where(a, q, 0.0) / np.where(a, q, 0.0).sum(-1, keepdims=True)
    ref = np.where(a, p * (np.log(np.where(a, p, 1.0)) - np.log(q)), 0.0).sum(-1)
    np.testing.assert_allclose(ref, -np.log(np.where(a, q, 0.0).sum(-1)), rtol=1e-12)
    np.testing.assert_allclose(allowed_kl(allowed, student), ref, rtol=1e-5, atol=1e-6)
    assert ref.min() > 1e-3  # the restriction moves mass at every position
    mask = jax.random.bernoulli(km, 0.5, (b, t)).astype(jnp.float32)
    m = np.asarray(mask, bool)
    np.testing.assert_allclose(allowed_kl(allowed, student, mask), np.where(m, ref, 0.0),
                               rtol=1e-5, atol=1e-6)
    grad = jax.grad(lambda x: feedback_loss(allowed_kl(allowed, x, mask), mask, beta=0.4))(student)
    np.testing.assert_allclose(grad, 0.4 * (q - p) * m[..., None] / m.sum(), atol=1e-6)
    # a padded embedding: logits past the tokenizer's vocabulary are never allowed
    padded = jnp.concatenate([student, jnp.full((b, t, 3), 4.0)], axis=-1)
    q_pad = np.exp(np.asarray(padded, np.float64))
    q_pad /= q_pad.sum(-1, keepdims=True)
    np.testing.assert_allclose(allowed_kl(allowed, padded),
                               -np.log(np.where(a, q_pad[..., :v], 0.0).sum(-1)), rtol=1e-5)
    with pytest.raises(ValueError, match="allowed sets over 7 tokens for 6 logits"):
        allowed_kl(allowed, student[..., :6])
    garbage = jnp.where(mask[..., None] != 0, student, jnp.nan)
    nothing = allowed & (mask[..., None] != 0)  # off the mask nothing is allowed either
    grad = jax.grad(lambda x: feedback_loss(allowed_kl(nothing, x, mask), mask, beta=1.0))(garbage)
    assert np.isfinite(np.asarray(grad)).all() and not np.asarray(grad)[~m].any()
