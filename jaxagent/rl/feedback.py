"""Targeted textual feedback (the seeds' Composer method) as a loss term.

At a turn a detector flagged (a malformed call, an edit to the tests, a repeated turn), the
teacher is the same policy with a short hint added to the context before that turn; it is
evaluated without gradient on the turn's own tokens, and the student (the policy in the
original context) is pulled towards it:

    loss = beta * aggregate_bt( m_bt * KL(teacher_bt || student_bt) )
    KL(p || q) = sum_v p_v (log p_v - log q_v)

Or the teacher is a script that knows the task (`agent.feedback_teacher: script`): its turn is
the call a scripted demonstration makes next, a point mass on each of its tokens y_bt, so the
KL is the student's negative log-likelihood of that call:

    KL(onehot(y) || q) = -log q_y

Or the teacher is the policy itself restricted to the tokens A_bt that keep the call
well-formed (`agent.feedback_teacher: grammar`), p = q 1[A] / q(A) under `stop_gradient`,
whose KL, and its gradient, is the log of the mass the student puts on them:

    KL(p || q) = sum_{v in A} (q_v / q(A)) log(1 / q(A)) = -log q(A)

Letters: B sequences, T positions of flagged-turn tokens (aligned between the two contexts),
V vocabulary. mask [B, T] is nonzero only at the tokens of flagged turns, so the term is
exactly zero where no detector fired.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxagent.rl.losses import aggregate


def token_kl(teacher_logits, student_logits, mask=None):
    """KL(softmax(teacher) || softmax(student)) per position [B, T]; no gradient to the
    teacher. With `mask` [B, T], 0 where it is 0: the logits there may hold garbage and are
    zeroed first, so not even a NaN gradient gets through."""
    if mask is not None:
        keep = (jnp.asarray(mask) != 0)[..., None]
        teacher_logits = jnp.where(keep, teacher_logits, 0.0)
        student_logits = jnp.where(keep, student_logits, 0.0)
    t = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1))
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.einsum("BTV,BTV->BT", jnp.exp(t), t - s)


def feedback_loss(kl, mask, *, beta, aggregation="token-mean", norm_length=None):
    """beta * the masked aggregate of the per-position KL [B, T] (`token_kl` with the mask;
    0 when the mask is empty)."""
    return beta * aggregate(kl, mask, aggregation=aggregation, norm_length=norm_length)


def target_kl(targets, student_logits, mask=None):
    """KL(point mass at `targets` || softmax(student)) = -log q[target] per position [B, T]
    (the scripted teacher's); with `mask`, 0 (and no gradient, not even a NaN) where it is 0."""
    if mask is not None:
        student_logits = jnp.where((jnp.asarray(mask) != 0)[..., None], student_logits, 0.0)
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(s, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
    return nll if mask is None else jnp.where(jnp.asarray(mask) != 0, nll, 0.0)


def allowed_kl(allowed, student_logits, mask=None):
    """KL(the student restricted to `allowed` [B, T, V] (bool) || the student) = -log q(allowed)
    per position [B, T] (the grammar teacher's); with `mask`, 0 (and no gradient) where it is 0.
    A position must allow at least one token where the mask is on. `allowed` may cover only
    the first V' <= V tokens (a tokenizer's inside a padded embedding): the rest are refused."""
    keep = jnp.asarray(allowed, bool)
    pad = student_logits.shape[-1] - keep.shape[-1]
    if pad < 0:
        raise ValueError(f"allowed sets over {keep.shape[-1]} tokens for "
                         f"{student_logits.shape[-1]} logits")
    keep = jnp.pad(keep, [(0, 0)] * (keep.ndim - 1) + [(0, pad)])
    if mask is not None:
        on = (jnp.asarray(mask) != 0)[..., None]
        student_logits = jnp.where(on, student_logits, 0.0)
        keep = keep | ~on  # off the mask every token is allowed: log q(all) = 0
    s = student_logits.astype(jnp.float32)
    inside = jax.nn.logsumexp(jnp.where(keep, s, -jnp.inf), axis=-1)
    return jax.nn.logsumexp(s, axis=-1) - inside
