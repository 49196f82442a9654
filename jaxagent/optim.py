"""The optax optimizer from config: AdamW, warmup + constant/cosine schedule, grad clipping."""

from __future__ import annotations

import optax

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


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    parts = []
    if cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2,
                             eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*parts)
