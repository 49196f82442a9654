"""Experts sharded over an `expert` mesh axis (8 fake CPU devices: data 2 x expert 4) give the
unsharded forward and train step, with each device holding E/4 experts."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from jaxagent.steps import pack, sft_step

E = 8
CFG = ModelConfig(vocab_size=53, hidden_size=20, intermediate_size=27, num_layers=2, num_heads=2,
                  num_kv_heads=1, head_dim=10, tie_embeddings=False, num_experts=E,
                  num_experts_per_tok=3, moe_intermediate_size=9, mlp_only_layers=(1,),
                  router_aux_loss_coef=0.1)
# Minimal local logical -> mesh mapping (sharding/rules.py holds the real one); others replicate.
RULES = {"expert": "expert"}


def mesh():
    return Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "expert"))


def place(params, m):
    """Every parameter onto the mesh by its logical axes."""
    def put(var):
        spec = P(*(RULES.get(a) for a in var.get_metadata()["logical_axes"]))
        return var.replace(jax.device_put(var[...], NamedSharding(m, spec)))
    return jax.tree.map(put, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_of(seed=0, n=4):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 53, rng.integers(3, 8)).tolist() for _ in range(n)]
    completions = [rng.integers(0, 53, rng.integers(2, 9)).tolist() for _ in range(n)]
    return pack(prompts, completions, bucket=8)


def expert_shards(params):
    w = dict(nnx.to_flat_state(params))[("layers", 0, "mlp", "w_gate")][...]
    return {s.data.shape for s in w.addressable_shards}, len(w.addressable_shards)


@pytest.mark.parametrize("dispatch", ["dropless", pytest.param("capacity", marks=pytest.mark.slow)])
def test_expert_sharded_forward_and_train_step_equal_unsharded(dispatch):
    cfg = dataclasses.replace(CFG, moe_dispatch=dispatch, capacity_factor=1.0)
    model = init_model(cfg, seed=4)
    # Larger router weights than the init so routing (and capacity drops) vary by token.
    for layer in model.layers:
        if layer.sparse:
            layer.mlp.router[...] *= 40.0
    graphdef, params = nnx.split(model)
    batch = batch_of()
    m = mesh()
    sharded = place(params, m)
    assert expert_shards(sharded) == ({(E // 4, 20, 9)}, 8)
    data = NamedSharding(m, P("data"))
    sharded_batch = jax.tree.map(lambda x: jax.device_put(x, data), batch)

    @jax.jit
    def forward(p, b):
        return nnx.merge(graphdef, p)(b.tokens, None, b.segment_ids, with_aux_loss=True)

    ref_logits, ref_aux = forward(params, batch)
    logits, aux = forward(sharded, sharded_batch)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(aux), float(ref_aux), rtol=1e-6)
    assert float(ref_aux) > 0

    tx = optax.sgd(0.5)
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # the step donates its inputs
    ref_new, _, ref_metrics = sft_step(graphdef, tx, copy(params), tx.init(params), batch)
    new, _, metrics = sft_step(graphdef, tx, copy(sharded), tx.init(sharded), sharded_batch)
    for key in ("sft/loss", "sft/aux_loss", "sft/grad_norm"):
        np.testing.assert_allclose(float(metrics[key]), float(ref_metrics[key]), rtol=1e-5)
    for a, b, p0 in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a) - np.asarray(p0), np.asarray(b) - np.asarray(p0),
                                   rtol=1e-4, atol=1e-6)
    # The updated experts stay where they were: E/4 per device.
    assert expert_shards(new) == ({(E // 4, 20, 9)}, 8)
