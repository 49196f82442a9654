"""Low-rank adapters (LoRA, arXiv 2106.09685) on the decoder's projections.

    W' = W + s A B,   s = alpha / r   (alpha / sqrt(r) with rslora)

Our weights are einsum-ready [in..., out...] (see hf.py), so a weight's adapter is
A [in..., r] and B [r, out...]: x W' = x W + s (x A) B, and the merged weight is
W + s tensordot(A, B). A starts uniform in +-1/sqrt(fan_in) and B at zero, so an adapted model
starts as its base; the embedding table's the other way round (as peft does). A module keeps
its adapters in `self.lora`, an nnx.Dict by HF module name (`LORA_TARGETS`); the factors are
`LoraParam`s, the only parameters a LoRA run trains: `nnx.split(model, LoraParam, ...)`.

A MoE layer's experts take per-expert adapters over their stacked weights, as `peft` does
(its ParamWrapper on transformers' fused expert tensors): expert e's update is s A_e B_e with
A [E, in, r'], B [E, r', P, out]. gate_proj and up_proj adapt the experts together, as one
adapter on the fused gate-up projection (P = 2 pieces, gate then up, sharing A) of rank
r' = 2r and alpha 2 alpha, the rank and alpha peft gives it; down_proj has P = 1, r' = r.
"""

from __future__ import annotations

import fnmatch
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxagent.errors import ConfigError
from jaxagent.models.config import LORA_TARGETS, LoraConfig, ModelConfig

# The weight each target adapts, an attribute of the module holding `lora`.
WEIGHT_OF = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
             "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down",
             "embed_tokens": "embed", "lm_head": "lm_head"}


class LoraParam(nnx.Param):
    """A factor (A or B) of a low-rank adapter."""


class SavedParam(LoraParam):
    """A base weight trained whole beside the adapters (a `model.lora.modules_to_save`
    module's): it trains, syncs and is checkpointed with them."""


class ExpertLoraParam(LoraParam):
    """A factor of a MoE layer's per-expert adapters (leading expert axis)."""


# The expert weights each expert adapter updates, in the order of B's pieces axis.
EXPERT_WEIGHTS = {"gate_up_proj": ("w_gate", "w_up"), "down_proj": ("w_down",)}


def is_b_factor(path: tuple) -> bool:
    """Whether a key path into a decoder's weights (as `jax.tree_util` gives it) leads to an
    adapter's B factor: (..., "lora", target, "b", ...)."""
    names = [getattr(key, "key", getattr(key, "name", None)) for key in path]
    return "lora" in names and names[names.index("lora") + 2:][:1] == ["b"]


def lora_targets(cfg: LoraConfig) -> frozenset[str]:
    """The module names `cfg.targets` match (none without a rank)."""
    if not cfg.rank:
        return frozenset()
    return frozenset(name for name in LORA_TARGETS
                     if any(fnmatch.fnmatchcase(name, p) for p in cfg.targets))


# The MLP's projections: in a sparse MoE layer they are the experts'.
MLP_TARGETS = frozenset({"gate_proj", "up_proj", "down_proj"})


def check_lora(lora: LoraConfig, tied: bool = False, moe: bool = False) -> None:
    """ConfigError naming the `model.lora` field a LoRA config gets wrong (`tied`: for a model
    whose LM head is its embedding table; `moe`: with sparse MoE layers)."""
    if lora.rank < 0:
        raise ConfigError(f"model.lora.rank: must be >= 0 (0: no adapters), got {lora.rank}")
    if not lora.rank:
        if lora.modules_to_save:
            raise ConfigError("model.lora.modules_to_save: needs model.lora.rank > 0 (without "
                              "adapters every weight trains)")
        return
    if lora.alpha <= 0:
        raise ConfigError(f"model.lora.alpha: must be > 0, got {lora.alpha}")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout: must be in [0, 1), got {lora.dropout}")
    unmatched = [p for p in lora.targets
                 if not any(fnmatch.fnmatchcase(name, p) for name in LORA_TARGETS)]
    if unmatched or not lora.targets:
        raise ConfigError(f"model.lora.targets: {unmatched or 'empty'} match no module; "
                          f"known: {', '.join(LORA_TARGETS)}")
    mlp = lora_targets(lora) & MLP_TARGETS
    if moe and len(mlp & {"gate_proj", "up_proj"}) == 1:
        raise ConfigError(f"model.lora.targets: {sorted(mlp)} adapts one of gate_proj and up_proj: "
                          "MoE experts adapt both together (one adapter on the fused gate-up "
                          "projection, as peft's gate_up_proj); target both or neither")
    if moe and mlp and lora.dropout:
        raise ConfigError(f"model.lora.dropout: {lora.dropout} with MoE expert adapters "
                          f"({sorted(mlp)}): the experts' adapters take no dropout (neither do "
                          "peft's); set 0, or target the attention only")
    saved = set(lora.modules_to_save)
    if saved - {"embed_tokens", "lm_head"} or ("lm_head" in saved and tied):
        raise ConfigError(f"model.lora.modules_to_save: {sorted(saved)} is not supported "
                          "(embed_tokens, and lm_head when model.tie_embeddings is false)")
    if saved & lora_targets(lora):
        raise ConfigError(f"model.lora.modules_to_save: {sorted(saved & lora_targets(lora))} "
                          "also adapted by model.lora.targets; a module trains one way")
    if "lm_head" in lora_targets(lora) and tied:
        raise ConfigError("model.lora.targets: lm_head needs model.tie_embeddings: false (a tied "
                          "model's head is the embedding table; target embed_tokens)")


def dropout_key(cfg: LoraConfig, seed: int, stage: int, step: int) -> jax.Array | None:
    """A training step's dropout key, None without dropout: a function of (seed, stage, step),
    so a resumed run draws the same masks (stage 0: SFT, 1: RL, apart so neither repeats the
    other's)."""
    if not (cfg.rank and cfg.dropout):
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stage), step)


def lora_scale(cfg: LoraConfig, rank: int | None = None) -> float:
    """s of an adapter of `rank` (default `cfg.rank`); a fused adapter of rank n r has alpha
    n alpha (peft's rank and alpha patterns), so s is unchanged unless rslora."""
    r = rank or cfg.rank
    alpha = cfg.alpha * r / cfg.rank
    return alpha / (math.sqrt(r) if cfg.rslora else r)


class Adapter(nnx.Module):
    """`adapter(x [..., in...]) -> s (x A) B [..., out...]`; `lookup(tokens)` for a table.
    With a `key` (training), x is first dropped out at rate `model.lora.dropout`."""

    def __init__(self, cfg: LoraConfig, ins: tuple[tuple[int, str], ...],
                 outs: tuple[tuple[int, str], ...], *, rngs: nnx.Rngs, table: bool = False):
        r = cfg.rank
        in_shape, in_axes = zip(*ins)
        out_shape, out_axes = zip(*outs)
        a_shape, b_shape = (*in_shape, r), (r, *out_shape)
        if table:  # a lookup: A zero, B normal (peft's choice)
            a = jnp.zeros(a_shape, jnp.float32)
            b = jax.random.normal(rngs.params(), b_shape, jnp.float32)
        else:
            bound = 1 / math.sqrt(math.prod(in_shape))
            a = jax.random.uniform(rngs.params(), a_shape, jnp.float32, -bound, bound)
            b = jnp.zeros(b_shape, jnp.float32)
        self.a = LoraParam(a, logical_axes=(*in_axes, None))
        self.b = LoraParam(b, logical_axes=(None, *out_axes))
        self.scale = lora_scale(cfg)
        self.dropout = cfg.dropout

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        dt = x.dtype
        if key is not None and self.dropout:
            keep = jax.random.bernoulli(key, 1 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1 - self.dropout), 0).astype(dt)
        h = jnp.tensordot(x, self.a[...].astype(dt), axes=self.a.ndim - 1)
        return self.scale * jnp.tensordot(h, self.b[...].astype(dt), axes=1)

    def lookup(self, tokens: jax.Array, dtype) -> jax.Array:
        h = jnp.take(self.a[...], tokens, axis=0).astype(dtype)
        return self.scale * jnp.tensordot(h, self.b[...].astype(dtype), axes=1)


class ExpertAdapter(nnx.Module):
    """Per-expert adapters of the stacked expert weights `EXPERT_WEIGHTS[name]`, W_p [E, in, out]
    (P of them, fused into one adapter): A [E, in, r'] and B [E, r', P, out], r' = P r; expert
    e's update of W_p is s A_e B_e[:, p]. A starts uniform in +-1/sqrt(in), B at zero (as peft's)."""

    def __init__(self, cfg: LoraConfig, name: str, experts: int, ins: tuple[int, str],
                 outs: tuple[int, str], *, rngs: nnx.Rngs):
        self.weights = EXPERT_WEIGHTS[name]
        r = cfg.rank * len(self.weights)
        bound = 1 / math.sqrt(ins[0])
        a = jax.random.uniform(rngs.params(), (experts, ins[0], r), jnp.float32, -bound, bound)
        b = jnp.zeros((experts, r, len(self.weights), outs[0]), jnp.float32)
        self.a = ExpertLoraParam(a, logical_axes=("expert", ins[1], None))
        self.b = ExpertLoraParam(b, logical_axes=("expert", None, None, outs[1]))
        self.scale = lora_scale(cfg, r)

    def factors(self, dtype) -> dict[str, tuple[jax.Array, jax.Array, float]]:
        """{expert weight name: (A, its B piece [E, r', out], s)} in `dtype`."""
        a, b = self.a[...].astype(dtype), self.b[...].astype(dtype)
        return {w: (a, b[:, :, i], self.scale) for i, w in enumerate(self.weights)}


def make_expert_adapters(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Dict:
    """A MoE layer's expert adapters: gate_up_proj if gate_proj and up_proj are targeted,
    down_proj if it is."""
    targets = lora_targets(cfg.lora)
    e, d, f = cfg.num_experts, (cfg.hidden_size, "embed"), (cfg.moe_intermediate_size, "mlp")
    adapters = {}
    if {"gate_proj", "up_proj"} <= targets:
        adapters["gate_up_proj"] = ExpertAdapter(cfg.lora, "gate_up_proj", e, d, f, rngs=rngs)
    if "down_proj" in targets:
        adapters["down_proj"] = ExpertAdapter(cfg.lora, "down_proj", e, f, d, rngs=rngs)
    return nnx.Dict(adapters)


def make_adapters(cfg: ModelConfig, weights: dict, *, rngs: nnx.Rngs) -> nnx.Dict:
    """The adapters of a module's targeted weights: `weights` maps an HF module name to
    ((size, logical axis) of its inputs, ... of its outputs)."""
    targets = lora_targets(cfg.lora)
    return nnx.Dict({name: Adapter(cfg.lora, ins, outs, rngs=rngs, table=name == "embed_tokens")
                     for name, (ins, outs) in weights.items() if name in targets})


def adapted(lora: nnx.Dict, name: str, x: jax.Array, y: jax.Array,
            key: jax.Array | None = None) -> jax.Array:
    """y = x W plus the adapter of `name`'s update, if `name` is targeted (`key`: a training
    pass's dropout key for the module; each target draws its own mask from it)."""
    if name not in lora:
        return y
    if key is not None:
        key = jax.random.fold_in(key, LORA_TARGETS.index(name))
    return y + lora[name](x, key)


def merge(base: nnx.State, factors: nnx.State, cfg: LoraConfig) -> nnx.State:
    """`base` with each adapted weight W replaced by W + s A B (summed in float32, in W's dtype;
    an expert adapter's W_p by W_p + s A_e B_e[:, p] for each expert e)."""
    weights = dict(nnx.to_flat_state(base))
    factor = dict(nnx.to_flat_state(factors))
    for path, var in factor.items():
        if isinstance(var, SavedParam):  # trained whole: it replaces the base's
            weights[path] = nnx.Param(var[...], **var.get_metadata())
    for path in [p for p in factor if p[-1] == "a"]:
        *owner, _, name, _ = path  # (..., "lora", name, "a")
        a = factor[path][...].astype(jnp.float32)
        b = factor[(*path[:-1], "b")][...].astype(jnp.float32)
        s = lora_scale(cfg, a.shape[-1])
        if isinstance(factor[path], ExpertLoraParam):
            delta = s * jnp.einsum("EIR,ERPO->PEIO", a, b)
            updates = dict(zip(EXPERT_WEIGHTS[name], delta))
        else:
            updates = {WEIGHT_OF[name]: s * jnp.tensordot(a, b, axes=1)}
        for weight, delta in updates.items():
            w = weights[(*owner, weight)]
            weights[(*owner, weight)] = w.replace(
                (w[...].astype(jnp.float32) + delta).astype(w.dtype))
    return nnx.from_flat_state(weights)
