"""Group-relative advantages and reward shaping for GRPO / RLOO / DAPO.

Letters: N groups (prompts), G samples per group (completions of one prompt).

Every function is pure and jit-compatible; keyword options (``normalize_std``, ``max_len``, ...)
are meant to be static. Rewards are data, not parameters, but the functions stay differentiable
and NaN-free (also in the gradient) so that nothing upstream can be poisoned by them.
"""

from __future__ import annotations

import jax.numpy as jnp


def _group_std(rewards):
    """Population std (ddof=0) over the group axis, [N, G] -> [N, 1], with a finite gradient at 0.

    sqrt has an infinite derivative at 0, and 0 * inf = NaN in the backward pass of a
    zero-variance group, hence the double ``where``.
    """
    centered = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    positive = var > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)


def _all_equal(rewards):
    """[N, G] -> [N, 1] bool: every reward of the group equals the first, exactly."""
    return jnp.all(rewards == rewards[..., :1], axis=-1, keepdims=True)


def grpo_advantages(rewards, *, normalize_std=True, eps=1e-6):
    """GRPO advantages: each reward relative to its own group.

        A_i = (r_i - mean_j r_j) / (std_j r_j + eps)    if normalize_std   (GRPO)
        A_i =  r_i - mean_j r_j                          otherwise          (Dr.GRPO)

    std is the *population* std (ddof=0): sqrt(mean_j (r_j - mean)^2).

    A group whose rewards are all exactly equal gets exactly 0 (not merely ~1e-11 from
    the rounding of the mean), so it adds nothing to the loss; no NaN, also in the gradient.

    rewards: [N, G] -> advantages [N, G] (same float dtype).
    """
    rewards = jnp.asarray(rewards)
    centered = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
    if normalize_std:
        centered = centered / (_group_std(rewards) + eps)
    return jnp.where(_all_equal(rewards), 0.0, centered)


def rloo_advantages(rewards):
    """RLOO (leave-one-out) advantages: each reward minus the mean of the *other* G-1.

        A_i = r_i - (sum_j r_j - r_i) / (G - 1)  =  G / (G - 1) * (r_i - mean_j r_j)

    As in grpo_advantages, a group of exactly equal rewards gets exactly 0.

    rewards: [N, G] with G >= 2 (checked on the static shape) -> [N, G].
    """
    rewards = jnp.asarray(rewards)
    group_size = rewards.shape[-1]
    if group_size < 2:
        raise ValueError(f"rloo_advantages needs a group size G >= 2, got rewards of shape {rewards.shape}")
    others_mean = (jnp.sum(rewards, axis=-1, keepdims=True) - rewards) / (group_size - 1)
    return jnp.where(_all_equal(rewards), 0.0, rewards - others_mean)


def group_has_signal(rewards, *, eps=1e-6):
    """DAPO dynamic-sampling filter: True where the group's rewards differ.

        has_signal = (not all r_j equal) and std_j r_j > eps     (population std)

    A group with all-equal rewards (all pass / all fail) gets exactly zero advantage from
    grpo_advantages and rloo_advantages, so no gradient; DAPO drops such groups and samples
    more. The exact test makes that False for any eps (the std of a constant group computed
    in float can be a few ulps above 0); eps also drops groups that differ only by float noise.

    rewards: [N, G] -> [N] bool.
    """
    rewards = jnp.asarray(rewards)
    return (~_all_equal(rewards) & (_group_std(rewards) > eps))[..., 0]


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


def masked_grpo_advantages(rewards, valid, *, normalize_std=True, eps=1e-6):
    """GRPO advantages over the valid members of each group only (agent episodes cut by a
    budget are masked out of the advantage): with v the 0/1 validity and n = sum_j v_j,

        mean = sum_j v_j r_j / n,   std = sqrt(sum_j v_j (r_j - mean)^2 / n)
        A_i  = v_i (r_i - mean) / (std + eps)     (or v_i (r_i - mean) without normalize_std)

    Invalid members get exactly 0 and do not move their group's statistics; a group with fewer
    than two valid members, or whose valid rewards are all equal, gets exactly 0. With every
    member valid this is `grpo_advantages`.

    rewards, valid: [N, G] -> advantages [N, G].
    """
    rewards = jnp.asarray(rewards)
    v = (jnp.asarray(valid) != 0).astype(rewards.dtype)
    n = jnp.sum(v, axis=-1, keepdims=True)
    safe_n = jnp.maximum(n, 1.0)
    r = jnp.where(v > 0, rewards, 0.0)  # garbage at invalid members never reaches the result
    mean = jnp.sum(r, axis=-1, keepdims=True) / safe_n
    centered = v * (r - mean)
    if normalize_std:
        var = jnp.sum(centered * centered, axis=-1, keepdims=True) / safe_n
        positive = var > 0
        std = jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)
        centered = centered / (std + eps)
    first = jnp.sum(jnp.where(jnp.cumsum(v, axis=-1) == 1, r * v, 0.0), axis=-1, keepdims=True)
    all_equal = jnp.all((v == 0) | (r == first), axis=-1, keepdims=True)
    return jnp.where(all_equal | (n < 2), 0.0, centered)
