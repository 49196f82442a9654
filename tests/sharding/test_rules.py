"""Logical-axis rules: specs, real per-device shards, activations pinned in the rules context,
and the sharded train step equal to the single-device one on every layout (8 fake CPU devices)."""


import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxagent.models import init_model, logical_axes
from jaxagent.models.config import ModelConfig
from jaxagent.models.params import logical_spec
from jaxagent.steps import LossOptions, TrainBatch, rl_step
from sharding.config import DEFAULT_AXIS_RULES, MeshConfig
from sharding.mesh import build_mesh
from sharding.rules import (
    activation_rules,
    place,
    shard_batch,
    shardings,
)

# Distinct sizes: V 72, D 24, F 40, N 6, K 3 (divides no mesh axis: stays replicated), H 10.
MODEL = ModelConfig(vocab_size=72, hidden_size=24, intermediate_size=40, num_layers=2,
                    num_heads=6, num_kv_heads=3, head_dim=10, tie_embeddings=False,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
# MoE: E 6 experts (3 per device on expert=2), top-2, expert mlp 14; layer 1 stays dense.
MOE = dataclasses.replace(MODEL, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=14,
                          mlp_only_layers=(1,), router_aux_loss_coef=0.1)
_slow = pytest.mark.slow  # tens of seconds of compiling each on 2 shared cores
LAYOUTS = [
    pytest.param({"data": 8}, marks=_slow),
    pytest.param({"data": 1, "fsdp": 8}, marks=_slow),
    pytest.param({"data": 4, "tensor": 2}, marks=_slow),
    {"data": 2, "fsdp": 2, "tensor": 2},  # default run: data, fsdp and tensor at once
    pytest.param({"data": 1, "fsdp": 4, "expert": 2}, marks=_slow),  # with the MoE model
]


def _mesh(**sizes):
    return build_mesh(MeshConfig(**sizes))


def test_logical_spec_follows_rules_and_skips_what_cannot_split():
    mesh = _mesh(data=1, fsdp=4, tensor=2)
    rules = DEFAULT_AXIS_RULES
    assert logical_spec((24, 6, 10), ("embed", "heads", "head_dim"), rules, mesh) == \
        P("fsdp", "tensor", None)
    # kv_heads 3 is not divisible by tensor 2: replicated rather than unevenly split.
    assert logical_spec((24, 3, 10), ("embed", "kv_heads", "head_dim"), rules, mesh) == \
        P("fsdp", None, None)
    # The batch takes fsdp first, so the activation's embed dimension cannot reuse it.
    assert logical_spec((8, 5, 24), ("batch", "length", "embed"), rules, mesh) == \
        P("fsdp", None, None)
    # Size-1 mesh axes are left out; several axes on one dimension form a tuple.
    both = _mesh(data=2, fsdp=4)
    assert logical_spec((8, 5), ("batch", None), rules, both) == P(("data", "fsdp"), None)
    assert logical_spec((6, 5), ("batch", None), rules, both) == P("data", None)
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        logical_spec((4,), ("embed",), (("embed", "model"),), mesh)
    with pytest.raises(ValueError, match="do not match the shape"):
        logical_spec((4, 4), ("embed",), rules, mesh)


def test_activations_are_pinned_in_the_rules_context_only():
    """The model pins its residual stream [B, T, D] and logits [B, T, V] by logical names: in
    the rules context to the rules' layout (batch on data and fsdp, so embed stays whole;
    vocab on tensor), outside it not at all."""
    mesh = _mesh(data=2, fsdp=2, tensor=2)
    graphdef, params = nnx.split(init_model(MODEL, seed=1))
    params = place(params, mesh, DEFAULT_AXIS_RULES)
    tokens = shard_batch(np.zeros((8, 5), np.int32), mesh, DEFAULT_AXIS_RULES)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    assert "sharding_constraint" not in forward.lower(params, tokens).as_text()
    with activation_rules(mesh, DEFAULT_AXIS_RULES):
        text = forward.lower(params, tokens).as_text()
    pins = [line.split("<@mesh, ")[1].split(">")[0] for line in text.splitlines()
            if "sdy.sharding_constraint" in line]
    # the embeddings and each of the 2 layers' outputs, then the logits
    assert pins == ['[{"data", "fsdp"}, {}, {}]'] * 3 + ['[{"data", "fsdp"}, {}, {"tensor"}]']


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_params_are_sharded_as_the_rules_say(sizes):
    mesh = _mesh(**sizes)
    model = init_model(_model_for(sizes), seed=1)
    axes = logical_axes(model)
    params = place(nnx.state(model, nnx.Param), mesh, DEFAULT_AXIS_RULES)
    table = {row[0]: row[1:] for row in DEFAULT_AXIS_RULES}
    for path, var in nnx.to_flat_state(params):
        value = var.get_value()
        spec = value.sharding.spec
        names = axes[path]
        expected_shard = []
        for dim, (size, name, entry) in enumerate(zip(value.shape, names, spec)):
            mesh_axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
            # Only axes the rules give this name, never one of size 1.
            assert set(mesh_axes) <= set(table.get(name, ())), (path, names, spec)
            split = int(np.prod([mesh.shape[a] for a in mesh_axes]))
            expected_shard.append(size // split)
            # An axis the rules name, that is > 1, divides the size and is still free: used.
            for a in table.get(name, ()):
                earlier = {x for e in spec[:dim] if e for x in ((e,) if isinstance(e, str) else e)}
                if mesh.shape[a] > 1 and a not in earlier and size % (split * mesh.shape[a]) == 0:
                    assert a in mesh_axes, (path, names, spec)
        shards = value.addressable_shards
        assert len(shards) == 8
        assert {s.data.shape for s in shards} == {tuple(expected_shard)}, (path, spec)
    # Spot checks with the sizes spelled out.
    flat = dict(nnx.to_flat_state(params))
    wq = flat[("layers", 0, "attn", "wq")].get_value()
    shard = wq.addressable_shards[0].data.shape
    assert shard == (24 // mesh.shape["fsdp"], 6 // mesh.shape["tensor"], 10)
    lm_head = flat[("lm_head",)].get_value()
    assert lm_head.addressable_shards[0].data.shape == (24 // mesh.shape["fsdp"],
                                                        72 // mesh.shape["tensor"])
    for path, names in axes.items():
        if "expert" in names and mesh.shape["expert"] > 1:
            assert "expert" in str(flat[path].get_value().sharding.spec), path


def _model_for(sizes):
    """Layouts with an expert axis run the MoE model (any parameter named "expert" splits)."""
    return MOE if sizes.get("expert", 1) > 1 else MODEL


def _batch(rng, b=8, t=13, v=72):
    tokens = rng.integers(0, v, (b, t + 1))
    mask = (rng.random((b, t)) < 0.7).astype(np.float32)
    return TrainBatch(
        tokens=jnp.asarray(tokens[:, :-1], jnp.int32), targets=jnp.asarray(tokens[:, 1:], jnp.int32),
        loss_mask=jnp.asarray(mask),
        segment_ids=jnp.asarray((rng.random((b, t)) < 0.9).astype(np.int32)),
        sampler_logprobs=jnp.asarray(-rng.random((b, t)) * 5, jnp.float32) * mask,
        advantages=jnp.asarray(rng.normal(size=b), jnp.float32))


def _train(model, batches, mesh=None, micro_batch=0, logits_chunk=0):
    # SGD with momentum: parameter differences are linear in gradient differences (Adam's
    # 1/sqrt(v) would magnify summation-order noise on near-zero gradients).
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
    graphdef, params = nnx.split(model)
    opt_state = tx.init(params)
    if mesh is not None:
        params, opt_state = place((params, opt_state), mesh, DEFAULT_AXIS_RULES)
        batches = [shard_batch(b, mesh, DEFAULT_AXIS_RULES) for b in batches]
    options = LossOptions(kl_coef=0.0, entropy_coef=0.01)
    history = []
    # rl_step traces in the rules context: activations pinned to the mesh's layout
    rules = contextlib.nullcontext() if mesh is None else activation_rules(mesh, DEFAULT_AXIS_RULES)
    with rules:
        for batch in batches:
            params, opt_state, metrics = rl_step(graphdef, tx, params, opt_state, batch,
                                                 options=options, micro_batch=micro_batch,
                                                 logits_chunk=logits_chunk)
            history.append({k: float(v) for k, v in metrics.items()})
    return params, opt_state, history


_REFERENCES = {}


def _reference(model_cfg):
    """Single-device training of `model_cfg` on fixed batches (computed once per model)."""
    if model_cfg not in _REFERENCES:
        rng = np.random.default_rng(7)
        batches = [_batch(rng) for _ in range(2)]
        with jax.default_device(jax.devices()[0]):
            params, _, history = _train(init_model(model_cfg, seed=3), batches)
        _REFERENCES[model_cfg] = batches, params, history
    return _REFERENCES[model_cfg]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_sharded_train_step_equals_single_device(sizes):
    model_cfg = _model_for(sizes)
    batches, ref_params, ref_history = _reference(model_cfg)
    mesh = _mesh(**sizes)
    # The default layout also takes micro-batches and the LM head in chunks (of 5 positions
    # of 4 rows: 13 -> 3 chunks, the last padded); the reference has neither.
    default = sizes.get("data") == 2
    params, opt_state, history = _train(init_model(model_cfg, seed=3), batches, mesh,
                                        micro_batch=4 if default else 0,
                                        logits_chunk=20 if default else 0)
    for ref, got in zip(ref_history, history):
        assert ref.keys() == got.keys()
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], rtol=2e-5, atol=1e-6, err_msg=k)
    expected = place(nnx.state(params), mesh, DEFAULT_AXIS_RULES)
    for (path, got), (_, ref) in zip(nnx.to_flat_state(params), nnx.to_flat_state(ref_params)):
        np.testing.assert_allclose(np.asarray(got.get_value()), np.asarray(ref.get_value()),
                                   rtol=1e-5, atol=1e-6, err_msg=str(path))
    # The updated parameters and optimizer moments keep the rules' layout.
    for (path, got), (_, want) in zip(nnx.to_flat_state(params), nnx.to_flat_state(expected)):
        assert got.get_value().sharding.is_equivalent_to(want.get_value().sharding, got.ndim), path
    want = jax.tree.leaves(shardings(opt_state, mesh, DEFAULT_AXIS_RULES))
    for got, w in zip(jax.tree.leaves(opt_state), want, strict=True):
        assert got.sharding.is_equivalent_to(w, got.ndim)
