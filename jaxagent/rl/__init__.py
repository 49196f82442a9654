"""Pure RL math for GRPO / RLOO / DAPO / Dr.GRPO: advantages, losses, KL, log-probs.

Imports only jax and numpy; every function is pure and jit-compatible (string and size
options static). See advantages.py, losses.py and feedback.py for the formulas, and
algorithms.py for what each `rl.algorithm` sets; config.py holds the `rl` config section.
"""

from jaxagent.rl.advantages import (
    group_has_signal,
    grpo_advantages,
    masked_advantages,
    overlong_penalty,
    rloo_advantages,
    scale_negatives,
)
from jaxagent.rl.feedback import allowed_kl, feedback_loss, target_kl, token_kl
from jaxagent.rl.losses import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    aggregate,
    entropy_from_logits,
    importance_ratio_stats,
    kl_penalty,
    policy_loss,
    sequence_sums,
    token_logprobs,
    token_logprobs_and_entropy,
    truncated_importance_weights,
)

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "aggregate",
    "allowed_kl",
    "entropy_from_logits",
    "feedback_loss",
    "group_has_signal",
    "grpo_advantages",
    "importance_ratio_stats",
    "kl_penalty",
    "masked_advantages",
    "overlong_penalty",
    "policy_loss",
    "rloo_advantages",
    "scale_negatives",
    "sequence_sums",
    "target_kl",
    "token_kl",
    "token_logprobs",
    "token_logprobs_and_entropy",
    "truncated_importance_weights",
]
