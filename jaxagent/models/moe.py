"""A sparse mixture-of-experts MLP (Qwen3-MoE / Mixtral): top-k router, SwiGLU experts.

Letters: B batch, T time, N tokens (B*T), D model, F expert mlp, E experts, K experts per
token (top-k), A assignments (N*K), C capacity slots per expert, L sparse layers.

    p = softmax(x W_router)                      router probabilities [N, E]
    w, e = top_k(p)                              K weights and expert ids per token
    w = w / sum(w)                               if norm_topk_prob
    y = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x))   for e = e_k

Three dispatches compute the sum over the chosen experts:
- dropless: sort the N*K assignments by expert and run grouped (ragged) matmuls; exact, the
  default (HF parity, nothing lost), with a data-dependent group size per expert.
- capacity: scatter into fixed [E, C, D] buffers, C = ceil(capacity_factor * N * K / E);
  assignments past an expert's capacity (first choices have priority over second ones, then
  token order) and padding tokens are dropped: a dropped assignment adds nothing (its token
  keeps only the residual), the other weights are not renormalised. Static shapes whose E
  axis shards over an `expert` mesh axis with no gather of the weights.
- dense: every expert on every token, mixed by gates that are zero off the top-k: E/K times
  the expert FLOPs, no data movement; the plainest form of the math (a reference).

Each dispatch also runs the experts' LoRA adapters (lora.py), if any: expert e's projection
x W_e becomes x W_e + s (x A_e) B_e, both products through the dispatch's own per-expert matmul.

Parameters carry logical axes ("expert", "embed", "mlp"); `sharding/` maps them to a mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxagent.models.config import ModelConfig
from jaxagent.models.lora import make_expert_adapters
from jaxagent.models.params import param

# {expert weight name: (A [E, in, r], B [E, r, out], s)}: the experts' adapters (lora.py).
Adapters = dict[str, tuple[jax.Array, jax.Array, float]]


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    """HF Qwen3-MoE's rule: sparse unless dense-listed, every `decoder_sparse_step`-th layer."""
    return (cfg.num_experts > 0 and layer not in cfg.mlp_only_layers
            and (layer + 1) % cfg.decoder_sparse_step == 0)


def any_sparse(cfg: ModelConfig) -> bool:
    """Whether some layer's MLP is a sparse MoE layer."""
    return any(is_moe_layer(cfg, i) for i in range(cfg.num_layers))


def route(logits: jax.Array, k: int, normalise: bool) -> tuple[jax.Array, jax.Array]:
    """Router logits [N, E] -> top-k weights [N, K] (float32) and expert ids [N, K]."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalise:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


def _swiglu(x, w_gate, w_up, w_down, matmul, adapters: Adapters | None, out=None):
    """down(silu(gate(x)) * up(x)) per expert, each projection x W (+ s (x A) B with an
    adapter); `matmul(x, W)` is the dispatch's per-expert product, `out` the down projection's
    outer one (default `matmul`)."""
    adapters = adapters or {}

    def project(x, name, w, out=matmul):
        y = out(x, w)
        if name in adapters:
            a, b, s = adapters[name]
            y = y + s * out(matmul(x, a), b)
        return y

    h = jax.nn.silu(project(x, "w_gate", w_gate)) * project(x, "w_up", w_up)
    return project(h, "w_down", w_down, out or matmul)


def dropless_experts(x, weights, experts, w_gate, w_up, w_down,
                     adapters: Adapters | None = None) -> jax.Array:
    """sum_k weights[n, k] * expert_{experts[n, k]}(x[n]) -> [N, D], every assignment kept."""
    n, k = experts.shape
    flat = experts.reshape(-1)  # assignment a = n * K + k
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    group_sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)
    grouped = lambda a, w: jax.lax.ragged_dot(a, w.astype(a.dtype), group_sizes)
    out_sorted = _swiglu(x[order // k], w_gate, w_up, w_down, grouped, adapters)  # [A, D]
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(n, k, -1)
    return jnp.einsum("NKD,NK->ND", out, weights.astype(x.dtype))


def dense_experts(x, weights, experts, w_gate, w_up, w_down,
                  adapters: Adapters | None = None) -> jax.Array:
    """The same sum with every expert on every token and a [N, E] gate zero off the top-k."""
    dt = x.dtype
    one_hot = jax.nn.one_hot(experts, w_gate.shape[0], dtype=dt)  # [N, K, E]
    gates = jnp.einsum("NK,NKE->NE", weights.astype(dt), one_hot)
    per_expert = lambda a, w: jnp.einsum("NX,EXY->NEY" if a.ndim == 2 else "NEX,EXY->NEY",
                                         a, w.astype(dt))
    mixed = lambda h, w: jnp.einsum("NE,NEX,EXY->NY", gates, h, w.astype(dt))  # no [N, E, D]
    return _swiglu(x, w_gate, w_up, w_down, per_expert, adapters, out=mixed)


def capacity(num_tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Slots per expert; never more than N (a token picks an expert at most once)."""
    return max(1, min(num_tokens, math.ceil(factor * num_tokens * k / num_experts)))


def capacity_slots(experts: jax.Array, keep: jax.Array, num_experts: int,
                   slots: int) -> jax.Array:
    """Each assignment's slot in its expert's buffer [K, N]; `slots` (out of range) if dropped.

    Priority: all first choices in token order, then all second choices, ... (Switch/GShard).
    """
    order = experts.T  # [K, N]: choice-major
    one_hot = jax.nn.one_hot(order, num_experts, dtype=jnp.int32) * keep[None, :, None]
    taken = jnp.cumsum(one_hot.reshape(-1, num_experts), axis=0).reshape(one_hot.shape)
    slot = jnp.take_along_axis(taken, order[..., None], axis=-1)[..., 0] - 1
    return jnp.where(keep[None, :] & (slot < slots), slot, slots)


def capacity_experts(x, weights, experts, w_gate, w_up, w_down,
                     adapters: Adapters | None = None, *, keep, factor) -> jax.Array:
    """Like `dropless_experts`, through [E, C, D] buffers; over-capacity assignments add 0."""
    n, k = experts.shape
    e = w_gate.shape[0]
    c = capacity(n, k, e, factor)
    slot = capacity_slots(experts, keep, e, c)  # [K, N]
    expert_of = experts.T
    xs = jnp.broadcast_to(x, (k, *x.shape))  # [K, N, D]
    buffers = jnp.zeros((e, c, x.shape[-1]), x.dtype).at[expert_of, slot].set(xs, mode="drop")
    batched = lambda a, w: jnp.einsum("ECX,EXY->ECY", a, w.astype(a.dtype))
    out = _swiglu(buffers, w_gate, w_up, w_down, batched, adapters)  # [E, C, D]
    back = out.at[expert_of, slot].get(mode="fill", fill_value=0)  # [K, N, D]
    return jnp.einsum("KND,NK->ND", back, weights.astype(x.dtype))


def load_balancing_loss(router_logits: Sequence[jax.Array], k: int,
                        mask: jax.Array | None = None) -> jax.Array:
    """Switch / HF `load_balancing_loss_func`: E * sum_e f_e * P_e over all sparse layers.

    f_e: top-k assignments to expert e per token, P_e: mean router probability of e, both
    pooled over the layers' real tokens (mask [N], 1 = real). f is not differentiable.
    """
    logits = jnp.stack([x.astype(jnp.float32) for x in router_logits])  # [L, N, E]
    e = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, chosen = jax.lax.top_k(probs, k)
    counts = jax.nn.one_hot(chosen, e, dtype=jnp.float32).sum(-2)  # [L, N, E]
    m = jnp.ones(logits.shape[1]) if mask is None else mask.astype(jnp.float32)
    rows = logits.shape[0] * jnp.maximum(m.sum(), 1.0)
    f = jnp.einsum("LNE,N->E", counts, m) / rows
    p = jnp.einsum("LNE,N->E", probs, m) / rows
    return e * jnp.sum(f * p)


class MoE(nnx.Module):
    """`moe(x [B, T, D], mask [B, T]) -> (y [B, T, D], router logits [N, E])`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        e, k, d, f, pd = (cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                          cfg.moe_intermediate_size, cfg.param_dtype)
        if not 0 < k <= e:
            raise ValueError(f"model.num_experts_per_tok ({k}) must be in [1, model.num_experts "
                             f"({e})]")
        if f < 1:
            raise ValueError(f"model.moe_intermediate_size must be >= 1, got {f}")
        if cfg.capacity_factor <= 0:
            raise ValueError(f"model.capacity_factor must be > 0, got {cfg.capacity_factor}")
        self.cfg = cfg
        # The router stays replicated over experts: every token needs all E logits.
        self.router = param(rngs, (d, e), ("embed", None), pd)
        self.w_gate = param(rngs, (e, d, f), ("expert", "embed", "mlp"), pd)
        self.w_up = param(rngs, (e, d, f), ("expert", "embed", "mlp"), pd)
        self.w_down = param(rngs, (e, f, d), ("expert", "mlp", "embed"), pd)
        self.lora = make_expert_adapters(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        logits = jnp.einsum("ND,DE->NE", tokens, self.router[...].astype(x.dtype))
        weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        # in the compute dtype, as every other layer (float32 masters, bfloat16 compute)
        w = (self.w_gate[...].astype(x.dtype), self.w_up[...].astype(x.dtype),
             self.w_down[...].astype(x.dtype))
        adapters = {w: f for adapter in self.lora.values()
                    for w, f in adapter.factors(x.dtype).items()}
        if cfg.moe_dispatch == "capacity":
            y = capacity_experts(tokens, weights, experts, *w, adapters, keep=mask.reshape(-1),
                                 factor=cfg.capacity_factor)
        elif cfg.moe_dispatch == "dense":
            y = dense_experts(tokens, weights, experts, *w, adapters)
        else:
            y = dropless_experts(tokens, weights, experts, *w, adapters)
        return y.reshape(b, t, d), logits
