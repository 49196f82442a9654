"""Policy-gradient losses, KL estimators and per-token log-prob helpers.

Letters: B sequences, T time (token positions), V vocabulary.

mask [B, T] marks the tokens that count (the response tokens the policy generated): nonzero
means "counts". Values at masked-out positions may be garbage (inf, NaN, padding); they never
reach the result or its gradient. Options such as ``aggregation`` and ``estimator`` are
strings and must be static under jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")


def _check_choice(name, value, allowed):
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def _as_bool(mask):
    return jnp.asarray(mask) != 0


def sequence_sums(values, mask, segments=None):
    """(per-sequence sums of the masked values, per-sequence masked-token counts, the number of
    sequences). Without `segments` each row is one sequence: [B], [B], B. With `segments`
    [B, T] (packed rows: the tokens of one sequence share an id > 0 within their row, 0 is
    padding) the sums and counts are over (row, id) bins, [B * (T + 1)] and mostly empty, and the
    number of sequences is that of distinct ids (ids run 1, 2, ... in each row)."""
    masked = jnp.where(mask, values, 0.0)  # where, not multiply: 0 * garbage (inf / NaN) is NaN
    if segments is None:
        return jnp.sum(masked, axis=-1), jnp.sum(mask, axis=-1), mask.shape[0]
    b, t = mask.shape  # a row holds at most t sequences: ids 0..t, t + 1 bins a row
    bins = (jnp.arange(b)[:, None] * (t + 1) + segments).reshape(-1)

    def per_bin(x):
        return jax.ops.segment_sum(x.reshape(-1), bins, num_segments=b * (t + 1))

    return per_bin(masked), per_bin(mask.astype(jnp.int32)), jnp.sum(jnp.max(segments, axis=-1))


def aggregate(values, mask, *, aggregation, norm_length=None, segments=None):
    """Reduce a per-token quantity [B, T] to a scalar over the masked tokens.

    With x = values, m = mask, n_b = sum_t m_bt (tokens of sequence b):

        "token-mean":               sum_bt m x / sum_bt m
        "seq-mean-token-mean":      mean over {b : n_b > 0} of (sum_t m x / n_b)
        "seq-mean-token-sum-norm":  (1/B) sum_b (sum_t m x) / norm_length      (Dr.GRPO)

    The Dr.GRPO form divides by the constant B * norm_length (all B sequences, empty ones
    included), so a token's weight does not depend on the lengths in the batch. ``norm_length``
    is required for it (typically the max response length) and ignored by the other two.
    A sequence is a row, or with `segments` (packed rows, see `sequence_sums`) the tokens of
    one id in a row. Empty sequences contribute nothing; an all-masked batch gives 0, never NaN.
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    if aggregation == "seq-mean-token-sum-norm":
        if norm_length is None:
            raise ValueError('aggregation="seq-mean-token-sum-norm" needs norm_length '
                             "(a constant, e.g. the max response length)")
        if isinstance(norm_length, (int, float)) and norm_length <= 0:
            raise ValueError(f"norm_length must be positive, got {norm_length}")
    mask = _as_bool(mask)
    if aggregation == "token-mean":
        return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(jnp.sum(mask), 1)
    sums, counts, sequences = sequence_sums(values, mask, segments)
    if aggregation == "seq-mean-token-mean":
        means = sums / jnp.maximum(counts, 1)
        nonempty = counts > 0
        return jnp.sum(jnp.where(nonempty, means, 0.0)) / jnp.maximum(jnp.sum(nonempty), 1)
    return jnp.sum(sums) / jnp.maximum(sequences, 1) / norm_length


def policy_loss(logprobs, old_logprobs, advantages, mask, *, clip_low=0.2, clip_high=0.2,
                aggregation="token-mean", norm_length=None, importance_weights=None,
                clip_ratio_c=None, segments=None):
    """PPO-clip surrogate (GRPO / DAPO / Dr.GRPO), to be minimised.

        rho_bt  = exp(logp_bt - old_logp_bt)
        s_bt    = min(rho_bt A_b, clip(rho_bt, 1 - clip_low, 1 + clip_high) A_b)
        s_bt    = max(s_bt, c A_b)  where A_b < 0, with clip_ratio_c = c > 1 (dual-clip)
        l_bt    = -w_bt * s_bt
        loss    = aggregate(l, mask, aggregation, norm_length)

    Dual-clip (Ye et al., 2020) bounds a negative-advantage token's loss by c |A| however
    large its ratio grows (stale rollouts under `off_policy: behaviour`); such a token then
    carries no gradient.

    w = stop_gradient(importance_weights) if given, else 1: the truncated IS weight between the
    proximal (old) and the behaviour (sampler) policy, decoupled PPO. clip_high > clip_low is
    DAPO's clip-higher. On-policy (logp == old_logp) the gradient is the REINFORCE one,
    -A_b * grad logp_bt, aggregated the same way.

    logprobs, old_logprobs, mask: [B, T]; advantages: [B], or [B, T] per token (packed rows,
    several sequences a row: `segments` as in `aggregate`); importance_weights: [B, T] or None.
    Only logprobs gets a gradient: old_logprobs, advantages and the weights are constants.
    Returns (loss, metrics); metrics are token means over the masked tokens, whatever the
    aggregation, and carry no gradient:
        clip_fraction  fraction of tokens where the clipped term is the smaller (active) one
        ratio_mean     mean rho;   ratio_max  max rho (0 if nothing is masked in)
        approx_kl      mean(old_logp - logp), the k1 estimate of KL(old || new)
        dual_clip_fraction  fraction of tokens where the dual-clip bound is active
    """
    _check_choice("aggregation", aggregation, AGGREGATIONS)
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"clip_ratio_c must be > 1 (or None: off), got {clip_ratio_c}")
    advantages = jax.lax.stop_gradient(jnp.asarray(advantages))
    if advantages.shape not in (jnp.shape(logprobs)[:1], jnp.shape(logprobs)):
        raise ValueError(f"advantages must be [B] (one per sequence) or [B, T] (per token) for "
                         f"logprobs of shape {jnp.shape(logprobs)}, got shape {advantages.shape}")
    mask = _as_bool(mask)
    # The old policy is a constant of the objective; stopping its gradient here also lets a
    # caller pass the same traced logprobs as both arguments for an on-policy step.
    old_logprobs = jax.lax.stop_gradient(old_logprobs)
    # Zero the log-ratio off-mask before exp: garbage there could overflow to inf, and inf
    # times a zero cotangent is NaN in the backward pass.
    log_ratio = jnp.where(mask, logprobs - old_logprobs, 0.0)
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    surrogate = jnp.minimum(unclipped, clipped)
    dual = jnp.zeros_like(surrogate, dtype=bool)
    if clip_ratio_c is not None:
        dual = (adv < 0) & (surrogate < clip_ratio_c * adv)
        surrogate = jnp.where(dual, clip_ratio_c * adv, surrogate)
    per_token = -surrogate
    if importance_weights is not None:
        per_token = per_token * jax.lax.stop_gradient(importance_weights)
    loss = aggregate(per_token, mask, aggregation=aggregation, norm_length=norm_length,
                     segments=segments)

    token_mean = lambda x: aggregate(x, mask, aggregation="token-mean")
    metrics = {
        "clip_fraction": token_mean((clipped < unclipped).astype(ratio.dtype)),
        "ratio_mean": token_mean(ratio),
        # ratio > 0, so 0 off-mask never wins the max unless nothing is masked in.
        "ratio_max": jnp.max(jnp.where(mask, ratio, 0.0)),
        "approx_kl": token_mean(-log_ratio),
        "dual_clip_fraction": token_mean(dual.astype(ratio.dtype)),
    }
    return loss, jax.lax.stop_gradient(metrics)


def kl_penalty(logprobs, ref_logprobs, *, estimator="k3", clamp=None):
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi (Schulman, 2020).

    With d = log pi_ref - log pi at the sampled token:
        k1 = -d                     unbiased, can be negative
        k2 = d^2 / 2                biased, >= 0; its gradient is the unbiased KL gradient
        k3 = exp(d) - 1 - d         unbiased, >= 0, low variance (the GRPO default)

    logprobs, ref_logprobs: [B, T] -> [B, T]. Reduce it with ``aggregate``. The gradient flows
    into logprobs only (the reference model is frozen). `clamp` (> 0, or None: off) bounds each
    token's estimate to [-clamp, clamp]: k3 grows as exp(d), 7e10 at d = 25, and a clamped
    token carries no gradient.
    """
    _check_choice("estimator", estimator, KL_ESTIMATORS)
    if clamp is not None and clamp <= 0:
        raise ValueError(f"clamp must be > 0 (or None: off), got {clamp}")
    d = jax.lax.stop_gradient(ref_logprobs) - logprobs
    if estimator == "k1":
        kl = -d
    elif estimator == "k2":
        kl = 0.5 * d * d
    else:  # expm1 keeps precision for small d; the max guards k3 >= 0 against rounding.
        kl = jnp.maximum(jnp.expm1(d) - d, 0.0)
    return kl if clamp is None else jnp.clip(kl, -clamp, clamp)


def _at_least_f32(x):
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def token_logprobs(logits, tokens):
    """log softmax(logits)_bt at the given tokens.

        logp_bt = logits_bt[tokens_bt] - logsumexp_v logits_btv

    logits: [B, T, V] (computed in at least float32); tokens: [B, T] int in [0, V) -> [B, T].
    """
    return token_logprobs_and_entropy(logits, tokens)[0]


def entropy_from_logits(logits, mask):
    """Mean per-token entropy of softmax(logits) over the masked tokens.

        H_bt = -sum_v p_btv log p_btv,   p = softmax(logits_bt),   result = token-mean of H

    logits: [B, T, V]; mask: [B, T] -> scalar. Stable for large logits (log_softmax) and for
    -inf logits (banned tokens: p log p = 0 there, no NaN in value or gradient).
    """
    tokens = jnp.zeros(jnp.shape(logits)[:-1], jnp.int32)
    entropy = token_logprobs_and_entropy(logits, tokens)[1]
    return aggregate(entropy, mask, aggregation="token-mean")


def token_logprobs_and_entropy(logits, tokens):
    """(logp [B, T], H [B, T]): the targets' log-probabilities and each position's entropy,
    sharing one exp pass over the [B, T, V] logits (a training step needs both; apart, the
    entropy metric cost a sixth of a small model's step).

        s = l - max_v l,   Z = sum_v exp(s),   logp_bt = s[tokens_bt] - log Z,
        H_bt = log Z - sum_v exp(s) s / Z
    """
    logits = _at_least_f32(logits)
    shifted = logits - jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    e = jnp.exp(shifted)
    total = e.sum(axis=-1)
    log_total = jnp.log(total)
    picked = jnp.take_along_axis(shifted, jnp.asarray(tokens)[..., None], axis=-1)[..., 0]
    # p log p = 0 where p = 0 (a -inf logit); the inner where keeps its gradient finite too.
    safe = jnp.where(e > 0, shifted, 0.0)
    return picked - log_total, log_total - (e * safe).sum(axis=-1) / total


def truncated_importance_weights(proximal_logprobs, behaviour_logprobs, *, cap=2.0):
    """Truncated IS weights between the proximal (trainer's old) and behaviour (sampler) policy.

        w_bt = stop_gradient(min(exp(proximal_bt - behaviour_bt), cap))

    The two log-probs differ even on-policy (different kernels, precision, batching), so the
    weight corrects for it; the cap bounds the variance. Computed as exp(min(delta, log cap)),
    which never overflows. [B, T] -> [B, T]; masked-out positions may hold garbage.
    """
    log_w = jnp.minimum(proximal_logprobs - behaviour_logprobs, jnp.log(cap))
    return jax.lax.stop_gradient(jnp.exp(log_w))


def importance_ratio_stats(proximal_logprobs, behaviour_logprobs, mask, *, cap=None):
    """Statistics of rho_bt = exp(proximal_bt - behaviour_bt) over the masked tokens:

        ratio_mean          sum m rho / sum m
        ratio_max           max over masked tokens of rho (0 if nothing is masked in)
        clipped_fraction    share of masked tokens with rho > cap (0 without a cap)

    They show how far the sampler's policy is from the trainer's. No gradient.
    """
    mask = _as_bool(mask)
    log_rho = jax.lax.stop_gradient(jnp.where(mask, proximal_logprobs - behaviour_logprobs, 0.0))
    rho = jnp.where(mask, jnp.exp(log_rho), 0.0)
    count = jnp.maximum(jnp.sum(mask), 1)
    clipped = mask & (log_rho > jnp.log(cap)) if cap is not None else jnp.zeros_like(mask)
    return {"ratio_mean": jnp.sum(rho) / count, "ratio_max": jnp.max(rho),
            "clipped_fraction": jnp.sum(clipped) / count}
