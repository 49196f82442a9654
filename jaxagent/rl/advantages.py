"""Group-relative advantages and reward shaping for GRPO / RLOO / DAPO.

Letters: N groups (prompts), G samples per group (completions of one prompt).

Every function is pure and jit-compatible; keyword options (``normalize_std``, ``max_len``, ...)
are meant to be static. Rewards are data, not parameters, but the functions stay differentiable
and NaN-free (also in the gradient) so that nothing upstream can be poisoned by them.
"""

from __future__ import annotations

import jax.numpy as jnp


def _masked_std(centered, n):
    """Population std (ddof=0) of a group's valid members, [N, 1], from their deviations
    `centered` [N, G] (0 at invalid members) and count `n` [N, 1]; finite gradient at 0.

    sqrt has an infinite derivative at 0, and 0 * inf = NaN in the backward pass of a
    zero-variance group, hence the double ``where``.
    """
    var = jnp.sum(centered * centered, axis=-1, keepdims=True) / jnp.maximum(n, 1.0)
    positive = var > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)


def _all_equal(r, v):
    """[N, G] rewards (0 at invalid members) and 0/1 validity -> [N, 1] bool: every valid
    reward of the group equals the first valid one, exactly."""
    first = jnp.sum(jnp.where(jnp.cumsum(v, axis=-1) == 1, r * v, 0.0), axis=-1, keepdims=True)
    return jnp.all((v == 0) | (r == first), axis=-1, keepdims=True)


def _group_stats(rewards, valid):
    """(r, v, n, total, centered): the rewards with invalid members zeroed (garbage there never
    reaches a result), the 0/1 validity, the valid count [N, 1], the valid rewards' sum
    [N, 1] and their deviations from the valid mean (0 at invalid members)."""
    rewards = jnp.asarray(rewards)
    v = (jnp.ones(rewards.shape, bool) if valid is None else jnp.asarray(valid) != 0
         ).astype(rewards.dtype)
    n = jnp.sum(v, axis=-1, keepdims=True)
    r = jnp.where(v > 0, rewards, 0.0)
    total = jnp.sum(r, axis=-1, keepdims=True)
    return r, v, n, total, v * (r - total / jnp.maximum(n, 1.0))


def masked_advantages(rewards, valid=None, *, baseline="mean", normalize_std=True, eps=1e-6):
    """Group advantages over the valid members of each group only (a rollout whose environment
    failed, or an agent episode cut by a budget, is masked out). With v the 0/1 validity,
    n = sum_j v_j, S = sum_j v_j r_j and mean = S / n:

        baseline "mean":           A_i = v_i (r_i - mean)                     (GRPO, Dr.GRPO)
        baseline "leave_one_out":  A_i = v_i (r_i - (S - r_i) / (n - 1))      (RLOO)

    each divided by (std + eps) if normalize_std, std = sqrt(sum_j v_j (r_j - mean)^2 / n)
    (population std). Invalid members get exactly 0 and do not move their group's statistics;
    a group with fewer than two valid members, or whose valid rewards are all exactly equal,
    gets exactly 0 (not merely ~1e-11 from the rounding of the mean), so it adds nothing to
    the loss; no NaN, also in the gradient. `valid` None: every member is valid.

    rewards, valid: [N, G] -> advantages [N, G] (the rewards' float dtype).
    """
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"baseline: 'mean' or 'leave_one_out', got {baseline!r}")
    r, v, n, total, centered = _group_stats(rewards, valid)
    adv = centered if baseline == "mean" else v * (r - (total - r) / jnp.maximum(n - 1, 1.0))
    if normalize_std:
        adv = adv / (_masked_std(centered, n) + eps)
    return jnp.where(_all_equal(r, v) | (n < 2), 0.0, adv)


def grpo_advantages(rewards, *, normalize_std=True, eps=1e-6):
    """GRPO advantages: each reward relative to its own group.

        A_i = (r_i - mean_j r_j) / (std_j r_j + eps)    if normalize_std   (GRPO)
        A_i =  r_i - mean_j r_j                          otherwise          (Dr.GRPO)

    std is the *population* std (ddof=0): sqrt(mean_j (r_j - mean)^2). A group of exactly
    equal rewards gets exactly 0 (see `masked_advantages`, of which this is the unmasked case).

    rewards: [N, G] -> advantages [N, G] (same float dtype).
    """
    return masked_advantages(rewards, normalize_std=normalize_std, eps=eps)


def rloo_advantages(rewards):
    """RLOO (leave-one-out) advantages: each reward minus the mean of the *other* G-1.

        A_i = r_i - (sum_j r_j - r_i) / (G - 1)  =  G / (G - 1) * (r_i - mean_j r_j)

    As in grpo_advantages, a group of exactly equal rewards gets exactly 0.

    rewards: [N, G] with G >= 2 (checked on the static shape) -> [N, G].
    """
    rewards = jnp.asarray(rewards)
    if rewards.shape[-1] < 2:
        raise ValueError(f"rloo_advantages needs a group size G >= 2, got rewards of shape {rewards.shape}")
    return masked_advantages(rewards, baseline="leave_one_out", normalize_std=False)


def group_has_signal(rewards, valid=None, *, eps=1e-6):
    """DAPO dynamic-sampling filter: True where the group's valid rewards differ.

        has_signal = n >= 2 and (not all valid r_j equal) and std_j r_j > eps
                     (over the valid members, population std)

    A group with all-equal rewards (all pass / all fail) gets exactly zero advantage from
    `masked_advantages`, so no gradient; DAPO drops such groups and samples more. The exact
    test makes that False for any eps (the std of a constant group computed in float can be a
    few ulps above 0); eps also drops groups that differ only by float noise. `valid` None:
    every member is valid.

    rewards, valid: [N, G] -> [N] bool.
    """
    r, v, n, _, centered = _group_stats(rewards, valid)
    return ((n >= 2) & ~_all_equal(r, v) & (_masked_std(centered, n) > eps))[..., 0]


def scale_negatives(advantages, scale):
    """Negative advantages times `scale`, positive ones as they are:

        A'_i = A_i          if A_i >= 0
        A'_i = scale * A_i  otherwise

    scale 1: unchanged; 0: positive-sample reinforcement only (PSR, Zhu et al. 2025, arXiv
    2506.01347: the policy's better-than-its-group samples made likelier, its worse ones left
    alone, which raises pass@1 fastest and pass@k least). A failing episode of a tiny policy
    shares most of its tokens (the call format) with the passing ones, and a full negative
    advantage pushes those down too; a scale below 1 leaves them less pushed.

    advantages: any shape; scale: a float >= 0 -> same shape and dtype.
    """
    advantages = jnp.asarray(advantages)
    return jnp.where(advantages < 0, scale * advantages, advantages)


def overlong_penalty(lengths, *, max_len, buffer_len, penalty=1.0):
    """DAPO soft overlong punishment, added to the task reward.

        R(L) = 0                                          L <= max_len - buffer_len
        R(L) = -penalty * (L - (max_len - buffer_len)) / buffer_len   in between
        R(L) = -penalty                                   L >= max_len

    i.e. -penalty * clip((L - max_len + buffer_len) / buffer_len, 0, 1).

    lengths: any shape, integer or float (response lengths in tokens) -> same shape, float.
    max_len, buffer_len: static, 0 < buffer_len <= max_len.
    """
    static = isinstance(buffer_len, (int, float)) and isinstance(max_len, (int, float))
    if static and not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong_penalty needs 0 < buffer_len <= max_len, "
                         f"got buffer_len={buffer_len}, max_len={max_len}")
    lengths = jnp.asarray(lengths)
    lengths = lengths.astype(jnp.result_type(lengths.dtype, float))
    excess = (lengths - (max_len - buffer_len)) / buffer_len
    return -penalty * jnp.clip(excess, 0.0, 1.0)
