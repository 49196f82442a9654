"""Mixed precision: float32 masters and AdamW state, bfloat16 compute, a bfloat16 sampler copy.

A learning rate of 1e-6 moves float32 weights but is below half a bfloat16 ulp of most of
them: with bfloat16 masters most weights would never change."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxagent.config import load_config
from jaxagent.models import init_model
from jaxagent.optim import make_optimizer
from jaxagent.steps import pack, target_logprobs
from rollouts.orchestrator import WeightStore
from rollouts.sampler import Sampler

CONFIGS = sorted(Path("configs").glob("*.yaml"))
# A small copy of each config's model, its dtypes kept.
SMALL = ["init_from=null", "model.vocab_size=61", "model.hidden_size=48",
         "model.intermediate_size=80", "model.num_layers=2", "model.num_heads=3",
         "model.num_kv_heads=1", "model.head_dim=16", "model.attention=dense",
         "model.attention_backend=xla", "model.num_experts=0",
         "optim.warmup_steps=0", "optim.schedule=constant"]  # the peak learning rate


def _changed_fraction(cfg) -> float:
    """The share of weights one AdamW step of `cfg.optim` changes, with gradients of a real
    loss's scale (Adam normalises them: what moves a weight is the learning rate against its
    dtype's resolution)."""
    import optax

    params = nnx.state(init_model(cfg.model, seed=1), nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    grads = jax.tree.unflatten(tree, [1e-3 * jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)
                                      for k, x in zip(keys, leaves)])
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    changed = sum(int(jnp.sum(a != b)) for a, b in zip(jax.tree.leaves(new), leaves, strict=True))
    return changed / sum(x.size for x in leaves)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_one_step_at_each_shipped_learning_rate_moves_the_weights(path):
    cfg = load_config(path, SMALL)
    assert cfg.model.param_dtype == "float32"  # masters, whatever the compute dtype
    assert _changed_fraction(cfg) >= 0.99


def test_bfloat16_masters_would_not_move():
    """The check above can fail: the same step on bfloat16 masters leaves most weights as they
    were (why the shipped configs keep float32 masters)."""
    cfg = load_config("configs/qwen2.5-coder-7b-humaneval-grpo.yaml",
                      [*SMALL, "model.param_dtype=bfloat16"])
    assert _changed_fraction(cfg) < 0.5


def test_the_sampler_holds_a_compute_copy_that_gives_the_trainers_numbers():
    cfg = load_config("configs/qwen2.5-coder-0.5b-humaneval-grpo.yaml", SMALL).model
    model = init_model(cfg, seed=3)
    sampler = Sampler(model)
    assert {x.dtype for x in jax.tree.leaves(sampler.params)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model))} == {jnp.dtype(jnp.float32)}
    prompts = [[5, 9, 17, 33, 2], [7, 1, 40]]
    out = sampler.generate(prompts, max_new_tokens=6, temperature=1.0, seed=4)
    batch = pack(prompts, out.tokens, out.logprobs, [1.0, 1.0], bucket=8)
    mask = np.asarray(batch.loss_mask) > 0
    logp = np.asarray(target_logprobs(model, batch)[0])[mask]  # float32 masters, bf16 compute
    # the same weights in the same dtype: equal up to bfloat16 evaluation-order rounding
    np.testing.assert_allclose(logp, np.asarray(batch.sampler_logprobs)[mask], atol=3e-2)
    # published weights arrive in the sampler's dtype: half the bytes of the masters
    store = WeightStore.like(sampler.params)
    store.publish(1, nnx.state(model))
    assert {x.dtype for x in jax.tree.leaves(store.take(1))} == {jnp.dtype(jnp.bfloat16)}
