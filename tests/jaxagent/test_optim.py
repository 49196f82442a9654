"""The optimizer: LoRA+ (each adapter's B factor at `optim.lora_plus_ratio` times the learning
rate) against a NumPy AdamW with per-factor learning rates; ratio 1 is the plain chain."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jaxagent.config import Config, OptimizerConfig, apply_overrides
from jaxagent.errors import ConfigError
from jaxagent.models import init_model
from jaxagent.models.adapters import split_trainable
from jaxagent.models.config import LoraConfig, ModelConfig
from jaxagent.optim import lora_plus, make_optimizer
from jaxagent.train.build import validate

DENSE = ModelConfig(vocab_size=53, hidden_size=15, intermediate_size=29, num_layers=1,
                    num_heads=3, num_kv_heads=1, head_dim=7, tie_embeddings=False,
                    lora=LoraConfig(rank=3, alpha=5.0, targets=("*_proj", "embed_tokens")))
MOE = dataclasses.replace(DENSE, family="qwen3_moe", num_experts=5, num_experts_per_tok=2,
                          moe_intermediate_size=11)


def trainable(cfg):
    return split_trainable(nnx.state(init_model(cfg, seed=0)))[0]


def is_b(path):  # the reference's own labels: nnx's flat paths end in the factor's name
    return path[-1] == "b"


def random_like(params, seed):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)


def flat(tree):
    return {path: np.asarray(v.get_value() if hasattr(v, "get_value") else v)
            for path, v in tree.flat_state()}


def numpy_adamw(params, grads_per_step, cfg, ratio):
    """AdamW by hand, each B factor's learning rate `ratio` x cfg.learning_rate."""
    p = {k: v.astype(np.float64) for k, v in flat(params).items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    for t, grads in enumerate(grads_per_step, start=1):
        for k, g in flat(grads).items():
            m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g
            v2[k] = cfg.b2 * v2[k] + (1 - cfg.b2) * g * g
            adam = (m[k] / (1 - cfg.b1 ** t)) / (np.sqrt(v2[k] / (1 - cfg.b2 ** t)) + cfg.eps)
            lr = cfg.learning_rate * (ratio if is_b(k) else 1.0)
            p[k] = p[k] - lr * (adam + cfg.weight_decay * p[k])
    return p


@pytest.mark.parametrize("model", [DENSE, MOE], ids=["dense+embedding", "moe-experts"])
def test_lora_plus_adamw_equals_per_factor_learning_rates(model):
    params = trainable(model)
    assert any(is_b(k) for k in flat(params)) and any(not is_b(k) for k in flat(params))
    cfg = OptimizerConfig(learning_rate=3e-3, weight_decay=0.07, max_grad_norm=0.0,
                          lora_plus_ratio=7.0)
    tx = make_optimizer(cfg, 10)
    grads_per_step = [random_like(params, seed) for seed in (1, 2, 3)]
    state, p = tx.init(params), params
    for grads in grads_per_step:
        updates, state = tx.update(grads, state, p)
        p = optax.apply_updates(p, updates)
    expected = numpy_adamw(params, grads_per_step, cfg, ratio=7.0)
    for k, value in flat(p).items():
        np.testing.assert_allclose(value, expected[k], rtol=1e-5, atol=1e-6, err_msg=str(k))


def test_lora_plus_under_sgd_moves_b_ratio_times_as_far():
    params = trainable(DENSE)
    grads = random_like(params, 4)
    tx = optax.chain(optax.sgd(0.1), lora_plus(4.5))
    updates, _ = tx.update(grads, tx.init(params), params)
    g = flat(grads)
    for k, u in flat(updates).items():
        np.testing.assert_allclose(u, -0.1 * (4.5 if is_b(k) else 1.0) * g[k], rtol=1e-6)


def test_ratio_1_is_the_plain_chain():
    params = trainable(DENSE)
    cfg = OptimizerConfig(learning_rate=2e-3, weight_decay=0.01, max_grad_norm=0.5)
    plain = optax.chain(optax.clip_by_global_norm(0.5),
                        optax.adamw(optax.constant_schedule(2e-3), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=0.01))
    tx = make_optimizer(cfg, 10)
    s_ours, s_plain = tx.init(params), plain.init(params)
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_plain)  # checkpoints unchanged
    for seed in (5, 6):
        grads = random_like(params, seed)
        u_ours, s_ours = tx.update(grads, s_ours, params)
        u_plain, s_plain = plain.update(grads, s_plain, params)
        for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_plain)):
            np.testing.assert_array_equal(a, b)


def test_lora_plus_without_adapters_or_at_ratio_0_is_a_config_error():
    full = nnx.state(init_model(dataclasses.replace(DENSE, lora=LoraConfig()), seed=0))
    with pytest.raises(ConfigError, match="optim.lora_plus_ratio"):
        make_optimizer(OptimizerConfig(lora_plus_ratio=4.0), 10).init(full)
    with pytest.raises(ConfigError, match="optim.lora_plus_ratio: must be > 0"):
        validate(apply_overrides(Config(), ["optim.lora_plus_ratio=0"]))
