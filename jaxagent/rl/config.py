"""The `rl` config section: the algorithm and its loss settings (a plain dataclass: rl stays
pure math). jaxagent.config composes it into `Config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RLConfig:
    # grpo: (r - mean) / std; dr_grpo: r - mean with a constant length normaliser;
    # rloo: leave-one-out baseline; dapo: grpo + clip-higher + dynamic sampling.
    # Validation fills each None below from the algorithm's preset (jaxagent/rl/algorithms.py);
    # a value set here wins, and the run's config.yaml holds the values used.
    algorithm: Literal["grpo", "rloo", "dr_grpo", "dapo"] = "grpo"
    group_size: int = 8  # G completions per prompt
    # Advantage baseline: the group's mean, or each member's mean of the others (rloo).
    baseline: Literal["mean", "leave_one_out"] | None = None
    normalize_std: bool | None = None  # divide advantages by the group's std (grpo, dapo)
    clip_low: float | None = None  # 0.2
    clip_high: float | None = None  # 0.2; dapo 0.28 (clip-higher)
    # token-mean; dr_grpo: seq-mean-token-sum-norm (over train.max_new_tokens)
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = None
    # Negative advantages times this (jaxagent.rl.scale_negatives): 1 = the algorithm's own;
    # 0 = only the better-than-group episodes reinforced (PSR), any algorithm
    negative_scale: float = 1.0
    kl_coef: float = 0.0  # > 0 keeps a frozen reference copy
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_clamp: float = 0.0  # > 0 bounds each token's KL estimate to [-kl_clamp, kl_clamp]; 0 = off
    # > 1 enables dual-clip: a negative-advantage token's loss is at most clip_ratio_c * |A|
    # (stale rollouts with off_policy: behaviour); 0 = off
    clip_ratio_c: float = 0.0
    entropy_coef: float = 0.0
    importance_cap: float = 2.0  # truncation of sampler -> trainer importance weights
    # decoupled: PPO ratio against the weights at the start of the update, times truncated
    # IS weights proximal/behaviour (AReaL); behaviour: PPO ratio against the sampler's logprobs.
    off_policy: Literal["decoupled", "behaviour"] = "decoupled"
    # Updates per batch: ppo_epochs passes over the batch cut into mini_batches (whole groups),
    # each a clipped step against the proximal log-probs taken once before the first. 1, 1:
    # one update per batch (the PPO clip then never acts: the ratio starts at 1).
    ppo_epochs: int = 1
    mini_batches: int = 1
    drop_zero_variance_groups: bool | None = None  # DAPO dynamic sampling (on for dapo)
    # With dynamic sampling: up to this many more draws of train.prompts_per_step tasks per
    # batch while it holds fewer groups with signal (rollout/groups_drawn, groups_kept); 0: off
    refill_draws: int = 0
    # DAPO soft overlong penalty over the last N of train.max_new_tokens (any algorithm; single
    # completions only); 0 = off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
