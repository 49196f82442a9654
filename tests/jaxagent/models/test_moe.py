"""The sparse MoE MLP against float64 NumPy references of the routing math, HF's load-balancing
loss, and a dense one-hot formulation; LoRA adapters on the experts against the merged
weights. Dimensions are distinct and odd (D 13, F 11, E 5 ...)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from jaxagent.models import moe as moe_lib
from jaxagent.models.config import LoraConfig, ModelConfig
from jaxagent.models.lora import ExpertLoraParam, LoraParam

D, F, E, K, N = 13, 11, 5, 2, 23
CFG = ModelConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K)


def make_moe(cfg=CFG, seed=0):
    layer = moe_lib.MoE(cfg, rngs=nnx.Rngs(params=seed))
    # Larger weights than the 0.02 init: distinct router probabilities, non-linear experts.
    state = nnx.state(layer, nnx.Param)
    nnx.update(layer, jax.tree.map(lambda w: w * 30.0, state))
    return layer


def tokens(n=N, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(1, n, D)), jnp.float32)


def weights64(layer):
    return {name: np.asarray(getattr(layer, name)[...], np.float64)
            for name in ("router", "w_gate", "w_up", "w_down")}


def expert64(w, e, x):
    silu = lambda a: a / (1 + np.exp(-a))
    return (silu(x @ w["w_gate"][e]) * (x @ w["w_up"][e])) @ w["w_down"][e]


def route64(w, x, k, normalise):
    logits = x @ w["router"]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    experts = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(p, experts, -1)
    if normalise:
        weights /= weights.sum(-1, keepdims=True)
    return weights, experts


def moe64(w, x, k, normalise, kept=None):
    """y_n = sum over (kept) choices j of weight * expert(x_n), token by token in float64."""
    weights, experts = route64(w, x, k, normalise)
    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(k):
            if kept is None or kept[j, n]:
                y[n] += weights[n, j] * expert64(w, experts[n, j], x[n])
    return y


@pytest.mark.parametrize("dispatch", ["dropless", "dense"])
@pytest.mark.parametrize("normalise", [True, False])
def test_moe_matches_float64_reference(normalise, dispatch):
    layer = make_moe(dataclasses.replace(CFG, norm_topk_prob=normalise, moe_dispatch=dispatch))
    x = tokens()
    y, logits = layer(x, jnp.ones((1, N), bool))
    w = weights64(layer)
    x64 = np.asarray(x[0], np.float64)
    np.testing.assert_allclose(np.asarray(logits), x64 @ w["router"], rtol=1e-5, atol=1e-4)
    ref = moe64(w, x64, K, normalise)
    np.testing.assert_allclose(np.asarray(y[0]), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # Not a trivial match: the experts differ and more than one is used.
    assert len(np.unique(route64(w, x64, K, normalise)[1])) == E


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_dispatch_and_its_gradients_equal_the_dense_one_hot_formulation(dispatch):
    layer = make_moe()
    x = tokens()[0]
    w = (layer.w_gate[...], layer.w_up[...], layer.w_down[...])
    weights, experts = moe_lib.route(x @ layer.router[...], K, True)
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=(N, D)), jnp.float32)

    def run(fn, *w):
        return (fn(x, weights, experts, *w) * cotangent).sum()

    if dispatch == "dropless":
        fn = moe_lib.dropless_experts
    else:  # a capacity of N slots per expert drops nothing
        fn = lambda *a: moe_lib.capacity_experts(*a, keep=jnp.ones(N, bool), factor=E / K)
    out = jax.value_and_grad(run, argnums=(1, 2, 3))(fn, *w)
    ref = jax.value_and_grad(run, argnums=(1, 2, 3))(moe_lib.dense_experts, *w)
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-5)
    for g, g_ref in zip(out[1], ref[1]):
        np.testing.assert_allclose(g, g_ref, rtol=1e-4, atol=1e-4 * np.abs(g_ref).max())


def test_capacity_mode_drops_assignments_past_capacity_first_choices_first():
    factor = 0.6
    layer = make_moe(dataclasses.replace(CFG, moe_dispatch="capacity", capacity_factor=factor))
    x = tokens()
    mask = np.ones(N, bool)
    mask[[3, 10, 17]] = False  # padding: dropped, and takes no slot
    y, _ = layer(x, jnp.asarray(mask)[None])
    w = weights64(layer)
    x64 = np.asarray(x[0], np.float64)
    c = moe_lib.capacity(N, K, E, factor)
    assert c == 6  # ceil(0.6 * 23 * 2 / 5)
    # The rule spelled out: first choices in token order, then second choices.
    _, experts = route64(w, x64, K, True)
    taken = np.zeros(E, int)
    kept = np.zeros((K, N), bool)
    for j in range(K):
        for n in range(N):
            if mask[n] and taken[experts[n, j]] < c:
                kept[j, n] = True
                taken[experts[n, j]] += 1
    assert 0 < (~kept[:, mask]).sum() and kept.sum() > N  # some dropped, most kept
    assert kept[1].sum() < kept[0].sum()  # second choices lose more
    ref = moe64(w, x64, K, True, kept)
    np.testing.assert_allclose(np.asarray(y[0]), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    np.testing.assert_array_equal(np.asarray(y[0])[~mask], 0.0)


def test_load_balancing_loss_equals_hf():
    rng = np.random.default_rng(3)
    b, t, layers = 3, 7, 4
    logits = [rng.normal(size=(b * t, E)).astype(np.float32) * 2 for _ in range(layers)]
    mask = np.ones((b, t), np.int64)
    mask[0, :2] = 0
    mask[2, 5:] = 0
    for m in (None, mask):
        ref = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), E, K,
                                       None if m is None else torch.tensor(m))
        ours = moe_lib.load_balancing_loss([jnp.asarray(x) for x in logits], K,
                                           None if m is None else jnp.asarray(m.reshape(-1)))
        np.testing.assert_allclose(float(ours), float(ref), rtol=1e-6)
    # Uniform routing gives the minimum, K (each token counts K assignments).
    uniform = moe_lib.load_balancing_loss([jnp.zeros((b * t, E))], K)
    np.testing.assert_allclose(float(uniform), K, rtol=1e-6)


def test_gradient_reaches_router_and_every_used_expert():
    layer = make_moe()
    x = tokens()
    graphdef, params = nnx.split(layer)

    def loss(p, aux_only):
        y, logits = nnx.merge(graphdef, p)(x, jnp.ones((1, N), bool))
        aux = moe_lib.load_balancing_loss([logits], K)
        return aux if aux_only else (y ** 2).sum()

    g = jax.grad(loss)(params, False)
    assert np.abs(np.asarray(g["router"][...])).min() > 0
    for name in ("w_gate", "w_up", "w_down"):
        per_expert = np.abs(np.asarray(g[name][...])).reshape(E, -1).max(-1)
        assert (per_expert > 0).all(), name
    g_aux = jax.grad(loss)(params, True)
    assert np.abs(np.asarray(g_aux["router"][...])).max() > 0
    assert all(np.all(np.asarray(g_aux[n][...]) == 0) for n in ("w_gate", "w_up", "w_down"))


def test_sparse_layers_follow_hf_rule():
    cfg = dataclasses.replace(CFG, num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [moe_lib.is_moe_layer(cfg, i) for i in range(6)] == [False, True, False, False, False, True]
    assert not moe_lib.is_moe_layer(dataclasses.replace(cfg, num_experts=0), 1)


def test_bad_moe_config_is_named():
    with pytest.raises(ValueError, match=r"model.num_experts_per_tok \(6\) must be in \[1, model.num_experts \(5\)\]"):
        moe_lib.MoE(dataclasses.replace(CFG, num_experts_per_tok=6), rngs=nnx.Rngs(0))


LORA = LoraConfig(rank=3, alpha=7.0, targets=("gate_proj", "up_proj", "down_proj"))


def with_random_adapters(cfg, seed=3):
    layer = make_moe(dataclasses.replace(cfg, lora=LORA))
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    nnx.update(layer, jax.tree.map(lambda f: 0.5 * jax.random.normal(next(keys), f.shape),
                                   nnx.state(layer, ExpertLoraParam)))  # B = 0 is the base
    return layer


def merged64(layer):
    """The layer's weights in float64 with each expert's W_p + s A_e B_e[:, p] merged in."""
    w = weights64(layer)
    for adapter in layer.lora.values():
        a, b = np.asarray(adapter.a[...], np.float64), np.asarray(adapter.b[...], np.float64)
        for p, name in enumerate(adapter.weights):
            w[name] = w[name] + adapter.scale * np.einsum("eir,ero->eio", a, b[:, :, p])
    return w


@pytest.mark.parametrize("dispatch", ["dropless", "capacity", "dense"])
def test_expert_adapters_equal_their_merged_weights(dispatch):
    layer = with_random_adapters(dataclasses.replace(CFG, moe_dispatch=dispatch,
                                                     capacity_factor=E / K))  # no drops
    assert {n: a.a.shape + a.b.shape for n, a in layer.lora.items()} == {
        "gate_up_proj": (E, D, 6, E, 6, 2, F), "down_proj": (E, F, 3, E, 3, 1, D)}
    x = tokens()
    y, _ = layer(x, jnp.ones((1, N), bool))
    w, x64 = merged64(layer), np.asarray(x[0], np.float64)
    ref = moe64(w, x64, K, True)
    np.testing.assert_allclose(np.asarray(y[0]), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert np.abs(ref - moe64(weights64(layer), x64, K, True)).max() > 0.1 * np.abs(ref).max()


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_expert_adapter_gradients_reach_the_adapters_only(dispatch):
    """d loss / d(A, B) through the dispatch equals it through the dense formulation of the
    merged weights W + s A B; the base weights and router are not differentiated."""
    layer = with_random_adapters(dataclasses.replace(CFG, moe_dispatch=dispatch,
                                                     capacity_factor=E / K))
    graph, factors, base = nnx.split(layer, LoraParam, ...)
    x = tokens()
    cotangent = jnp.asarray(np.random.default_rng(2).normal(size=(1, N, D)), jnp.float32)
    weights, experts = moe_lib.route(x[0] @ layer.router[...], K, True)

    def adapted(factors):
        return (nnx.merge(graph, factors, base)(x, jnp.ones((1, N), bool))[0] * cotangent).sum()

    def merged(factors):
        w = {n: getattr(layer, n)[...] for n in ("w_gate", "w_up", "w_down")}
        for name, adapter in layer.lora.items():
            a, b = factors["lora"][name]["a"][...], factors["lora"][name]["b"][...]
            for p, n in enumerate(adapter.weights):
                w[n] = w[n] + adapter.scale * jnp.einsum("EIR,ERO->EIO", a, b[:, :, p])
        y = moe_lib.dense_experts(x[0], weights, experts, w["w_gate"], w["w_up"], w["w_down"])
        return (y * cotangent[0]).sum()

    grads, ref = jax.grad(adapted)(factors), jax.grad(merged)(factors)
    assert {p for p, _ in nnx.to_flat_state(grads)} == {
        ("lora", n, f) for n in ("gate_up_proj", "down_proj") for f in "ab"}
    for (p, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref)):
        assert np.abs(r[...]).max() > 0, p
        np.testing.assert_allclose(g[...], r[...], rtol=1e-4, atol=1e-4 * np.abs(r[...]).max())
