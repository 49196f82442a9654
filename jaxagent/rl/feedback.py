"""Targeted textual feedback (the seeds' Composer method) as a loss term.

At a turn a detector flagged (a malformed call, an edit to the tests, a repeated turn), the
teacher is the same policy with a short hint added to the context before that turn; it is
evaluated without gradient on the turn's own tokens, and the student (the policy in the
original context) is pulled towards it:

    loss = beta * aggregate_bt( m_bt * KL(teacher_bt || student_bt) )
    KL(p || q) = sum_v p_v (log p_v - log q_v)

Letters: B sequences, T positions of flagged-turn tokens (aligned between the two contexts),
V vocabulary. mask [B, T] is nonzero only at the tokens of flagged turns, so the term is
exactly zero where no detector fired.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxagent.rl.losses import aggregate


def token_kl(teacher_logits, student_logits):
    """KL(softmax(teacher) || softmax(student)) per position [B, T]; no gradient to the teacher."""
    t = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1))
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
    return jnp.einsum("BTV,BTV->BT", jnp.exp(t), t - s)


def feedback_loss(teacher_logits, student_logits, mask, *, beta, aggregation="token-mean",
                  norm_length=None):
    """beta * the masked aggregate of `token_kl` (0 when the mask is empty)."""
    keep = (jnp.asarray(mask) != 0)[..., None]
    # Unflagged positions may hold garbage; zero them so not even a NaN gradient gets through.
    kl = token_kl(jnp.where(keep, teacher_logits, 0.0), jnp.where(keep, student_logits, 0.0))
    return beta * aggregate(kl, mask, aggregation=aggregation, norm_length=norm_length)
