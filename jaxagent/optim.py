"""The optax optimizer from config: AdamW, warmup + constant/cosine schedule, grad clipping,
LoRA+."""

from __future__ import annotations

import jax
import optax

from jaxagent.errors import ConfigError
from jaxagent.models.lora import is_b_factor
from jaxagent.train.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    warmup = max(cfg.warmup_steps, 0)
    if cfg.schedule == "cosine":
        decay = max(total_steps - warmup, 1)
        after = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps=decay)
    else:
        after = optax.constant_schedule(cfg.learning_rate)
    if warmup == 0:
        return after
    ramp = optax.linear_schedule(0.0, cfg.learning_rate, transition_steps=warmup)
    return optax.join_schedules([ramp, after], boundaries=[warmup])


def lora_plus(ratio: float) -> optax.GradientTransformation:
    """LoRA+ (Hayou et al. 2024, arXiv 2402.12354) after an optimizer: every adapter's B
    factor moves `ratio` times its update, so B's learning rate (weight decay included, as in
    a parameter group of its own) is `ratio` times A's; every other weight is untouched."""

    def init(params):
        if not any(is_b_factor(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)):
            raise ConfigError(f"optim.lora_plus_ratio: {ratio} scales the LoRA adapters' B "
                              "factors, but the trained weights have none (set model.lora.rank)")
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(
            lambda path, u: u * ratio if is_b_factor(path) else u, updates), state

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                             eps=cfg.eps, weight_decay=cfg.weight_decay))
    if cfg.lora_plus_ratio != 1:  # ratio 1 is plain LoRA: the same chain (and state) as ever
        parts.append(lora_plus(cfg.lora_plus_ratio))
    return optax.chain(*parts)
