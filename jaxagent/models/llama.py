"""A Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral decoder in Flax NNX.

Letters: B batch, T time, S source (keys), N heads, K kv heads, H head dim, D model, F mlp,
V vocab.

One module covers the family; the differences are config switches: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3), tied embeddings, RoPE scaling (Llama 3.1), sparse MoE MLPs
(Qwen3-MoE, Mixtral: `moe.py`). Every parameter carries `logical_axes` metadata and
activations are pinned by logical names (`params.constrain`); `sharding/` maps the names to mesh
axes from outside (a rules context); this file knows no mesh.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxagent.models.config import ModelConfig
from jaxagent.models.lora import SavedParam, adapted, check_lora, make_adapters
from jaxagent.models.moe import MoE, any_sparse, is_moe_layer, load_balancing_loss
from jaxagent.models.params import constrain
from jaxagent.models.params import param as _param
from pallas_kernels.attention import (
    dense_attention,
    document_attention,
    nsa_attention,
    resolve_backend,
)
from pallas_kernels.nsa import NSAShape, append_compressed, cache_keys, nsa_decode_step, nsa_forward

_BTD = ("batch", "length", "embed")  # logical names of the residual stream


# ---------------------------------------------------------------------------------------------
# KV cache: a pytree passed in and returned, so jitted decode steps stay pure.


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: list[jax.Array]  # per layer [B, K, S, H]
    v: list[jax.Array]  # per layer [B, K, S, H]
    segment_ids: jax.Array  # [B, S] int32; 0 = empty slot or padding
    index: jax.Array  # [] int32: the next slot to write
    # NSA only (None otherwise): compressed keys/values by block, per layer [B, K, C, H], and the
    # slot of each position of a row, [B, S] (its blocks are in positions, the cache in slots).
    k_cmp: list[jax.Array] | None = None
    v_cmp: list[jax.Array] | None = None
    slot_of: jax.Array | None = None
    # Within a decode segment of a dense model on CPU: the keys again, per layer [B, K, H, S],
    # so a step's q.K is a reduce over H with S the vectorised minor axis (3-4x faster on
    # XLA:CPU than over the minor H of [B, K, S, H]). Made by `with_keys_transposed`, dropped after.
    k_t: list[jax.Array] | None = None

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, size: int) -> "KVCache":
        shape = (batch, cfg.num_kv_heads, size, cfg.head_dim)
        zeros = [jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers)]
        nsa = {}
        if cfg.attention == "nsa":
            cmp = (batch, cfg.num_kv_heads, _nsa_blocks(cfg, size), cfg.head_dim)
            nsa = dict(k_cmp=[jnp.zeros(cmp, cfg.dtype) for _ in range(cfg.num_layers)],
                       v_cmp=[jnp.zeros(cmp, cfg.dtype) for _ in range(cfg.num_layers)],
                       slot_of=jnp.zeros((batch, size), jnp.int32))
        return cls(k=zeros, v=list(zeros), segment_ids=jnp.zeros((batch, size), jnp.int32),
                   index=jnp.zeros((), jnp.int32), **nsa)

    @property
    def size(self) -> int:
        return self.segment_ids.shape[1]

    def with_keys_transposed(self) -> "KVCache":
        return dataclasses.replace(self, k_t=[jnp.swapaxes(k, 2, 3) for k in self.k])

    def without_keys_transposed(self) -> "KVCache":
        return dataclasses.replace(self, k_t=None)

    def grow(self, cfg: ModelConfig, extra: int) -> "KVCache":
        """`extra` more empty slots (and, for NSA, room for the blocks they can complete)."""
        pad = lambda x, axis, n: jnp.pad(x, [(0, n if a == axis else 0) for a in range(x.ndim)])
        grown = dataclasses.replace(
            self, k=[pad(x, 2, extra) for x in self.k], v=[pad(x, 2, extra) for x in self.v],
            segment_ids=pad(self.segment_ids, 1, extra),
            k_t=None if self.k_t is None else [pad(x, 3, extra) for x in self.k_t])
        if self.slot_of is None:
            return grown
        more = _nsa_blocks(cfg, self.size + extra) - self.k_cmp[0].shape[2]
        return dataclasses.replace(
            grown, k_cmp=[pad(x, 2, more) for x in self.k_cmp],
            v_cmp=[pad(x, 2, more) for x in self.v_cmp], slot_of=pad(self.slot_of, 1, extra))


def _nsa_blocks(cfg: ModelConfig, size: int) -> int:
    """Compressed blocks a cache of `size` slots can need: positions < size, and a block closes
    every d positions from l-1 on (l >= d)."""
    return max(size // cfg.nsa.compress_stride, 1)


# ---------------------------------------------------------------------------------------------
# Rotary position embedding.


def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [H/2], with the configured scaling (HF `rope_type` semantics)."""
    h = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, h, 2, dtype=np.float64) / h))
    scaling = cfg.rope_scaling
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, blended, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate halves of [B, T, N, H] by angle position * inv_freq (HF `rotate_half` layout)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ---------------------------------------------------------------------------------------------
# Layers.


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, axis: str, *, param_dtype, rngs: nnx.Rngs):
        self.scale = _param(rngs, (dim,), (axis,), param_dtype, init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return xf.astype(x.dtype) * self.scale[...].astype(x.dtype)


def nsa_shape(cfg: ModelConfig) -> NSAShape:
    fields = {f.name for f in dataclasses.fields(NSAShape)}
    try:
        return NSAShape(**{k: v for k, v in dataclasses.asdict(cfg.nsa).items() if k in fields})
    except ValueError as e:
        raise ValueError(f"model.nsa: {e}") from None


class NSA(nnx.Module):
    """Native Sparse Attention's parameters and its attention (pallas_kernels.nsa): per layer, a
    compression MLP with intra-block position encoding for keys and for values (shared by the kv
    heads), and per-head sigmoid gates over the three branches, computed from the query.

    Positions are document positions: without a cache a row's tokens start at slot 0 (training
    batches are right-padded). With a cache, blocks are found by position through the cache's
    slot_of map (prompts are left-padded, multi-turn rows leave gaps), the compressed keys grow
    by one block every d tokens, and a decode step reads O(C + n*l' + w) keys.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.shape = nsa_shape(cfg)
        self.kernels = (cfg.nsa.kernels, cfg.nsa.gpu_kernels)
        l, h, n, pd = self.shape.compress_block, cfg.head_dim, cfg.num_heads, cfg.param_dtype

        def mlp():
            return {
                "pos": _param(rngs, (l, h), ("nsa_block", "head_dim"), pd),
                "w1": nnx.Param(
                    (jax.random.normal(rngs.params(), (l, h, h)) / math.sqrt(l * h)).astype(pd),
                    logical_axes=("nsa_block", "head_dim", "nsa_hidden"),
                ),
                "w2": nnx.Param(
                    (jax.random.normal(rngs.params(), (h, h)) / math.sqrt(h)).astype(pd),
                    logical_axes=("nsa_hidden", "head_dim"),
                ),
            }

        self.compress_k = nnx.Dict(mlp())
        self.compress_v = nnx.Dict(mlp())
        self.gate = _param(rngs, (n, h, 3), ("heads", "head_dim", "nsa_branch"), pd)

    def _params(self, dt):
        cast = lambda d: {name: d[name][...].astype(dt) for name in ("pos", "w1", "w2")}
        return {"compress_k": cast(self.compress_k), "compress_v": cast(self.compress_v),
                "gate": self.gate[...].astype(dt)}

    def __call__(self, q, k, v, positions, segment_ids, cache=None):
        """q [B,T,N,H]; k, v [B,K,S,H] (the cache layout; without a cache S = T) -> [B,T,N,H],
        and with a cache (k_cmp, v_cmp, slot_of) also the updated (k_cmp, v_cmp)."""
        params = self._params(q.dtype)
        if cache is None:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B,S,K,H], the kernels' layout
            kernels, gpu_kernels = self.kernels
            return nsa_attention(q, k, v, params, self.shape, kernels=kernels, gpu_kernels=gpu_kernels)
        k_cmp, v_cmp, slot_of = cache
        k_cmp = append_compressed(k_cmp, k, slot_of, positions, segment_ids, params["compress_k"], self.shape)
        v_cmp = append_compressed(v_cmp, v, slot_of, positions, segment_ids, params["compress_v"], self.shape)
        if q.shape[1] == 1:
            out = nsa_decode_step(q, k, v, k_cmp, v_cmp, positions[:, 0], params, self.shape,
                                  slot_of=slot_of)
        else:
            # A chunk (prefill): the keys by position, then the teacher-forced layer at an offset.
            # The last query is a real token (chunks are left-padded); padding queries get
            # negative positions, see nothing and output zeros.
            every = jnp.arange(slot_of.shape[1])[None, None, :]
            k_pos, v_pos, kc, vc = (jnp.swapaxes(x, 1, 2) for x in (  # [B,S|C,K,H]
                cache_keys(k, every, slot_of), cache_keys(v, every, slot_of), k_cmp, v_cmp))
            out = nsa_forward(q, k_pos, v_pos, params, self.shape, k_cmp=kc, v_cmp=vc,
                              offset=positions[:, -1] - (q.shape[1] - 1))
        return out, (k_cmp, v_cmp)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, n, k, h, pd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.param_dtype
        if n % k:
            raise ValueError(f"model.num_heads ({n}) must be a multiple of model.num_kv_heads ({k})")
        if cfg.attention != "nsa":  # fail at construction, not at the first call
            backend_name(cfg, "segments" if cfg.attention == "doc" else "causal")
        self.cfg = cfg
        self.wq = _param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pd)
        self.wk = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.wv = _param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pd)
        self.wo = _param(rngs, (n, h, d), ("heads", "head_dim", "embed"), pd)
        embed, heads = ((d, "embed"),), ((n, "heads"), (h, "head_dim"))
        kv_heads = ((k, "kv_heads"), (h, "head_dim"))
        self.lora = make_adapters(cfg, {"q_proj": (embed, heads), "k_proj": (embed, kv_heads),
                                        "v_proj": (embed, kv_heads), "o_proj": (heads, embed)},
                                  rngs=rngs)
        if cfg.attention_bias:
            self.bq = _param(rngs, (n, h), ("heads", "head_dim"), pd, init="zeros")
            self.bk = _param(rngs, (k, h), ("kv_heads", "head_dim"), pd, init="zeros")
            self.bv = _param(rngs, (k, h), ("kv_heads", "head_dim"), pd, init="zeros")
            if cfg.out_bias:
                self.bo = _param(rngs, (d,), ("embed",), pd, init="zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, "head_dim", param_dtype=pd, rngs=rngs)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, "head_dim", param_dtype=pd, rngs=rngs)
        if cfg.attention == "nsa":
            self.nsa = NSA(cfg, rngs=rngs)

    def __call__(self, x, positions, segment_ids, slots, dropout_key=None, cache_kv=None,
                 cache_segment_ids=None, cache_index=None, cache_nsa=None, cache_k_t=None,
                 rows="segments"):
        """-> (out [B,T,D], the layer's cache entries {"k", "v"[, "k_cmp", "v_cmp"][, "k_t"]} or None).
        `rows`: "causal" or "segments" (``pallas_kernels.attention.ROWS``); a call with a cache
        is "cached"."""
        cfg, dt, key = self.cfg, x.dtype, dropout_key
        q = adapted(self.lora, "q_proj", x,
                    jnp.einsum("BTD,DNH->BTNH", x, self.wq[...].astype(dt)), key)
        k = adapted(self.lora, "k_proj", x,
                    jnp.einsum("BTD,DKH->BTKH", x, self.wk[...].astype(dt)), key)
        v = adapted(self.lora, "v_proj", x,
                    jnp.einsum("BTD,DKH->BTKH", x, self.wv[...].astype(dt)), key)
        if cfg.attention_bias:
            q, k, v = q + self.bq[...].astype(dt), k + self.bk[...].astype(dt), v + self.bv[...].astype(dt)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_frequencies(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H], cache layout

        if cache_kv is None:
            kv_segment_ids, kv_slots, new_kv = segment_ids, slots, None
        else:
            rows = "cached"
            k_cache, v_cache = cache_kv
            k_new = k
            start = (0, 0, cache_index, 0)
            k = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), start)
            v = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), start)
            new_kv = {"k": k, "v": v}
            kv_segment_ids = cache_segment_ids
            kv_slots = jnp.broadcast_to(jnp.arange(k.shape[2], dtype=jnp.int32), kv_segment_ids.shape)
        if cache_k_t is not None:
            k_t = jax.lax.dynamic_update_slice(
                cache_k_t, jnp.swapaxes(k_new, 2, 3).astype(cache_k_t.dtype), (0, 0, 0, cache_index))
            new_kv["k_t"] = k_t
            out = dense_attention(q, k_t.astype(dt), v.astype(dt), q_segment_ids=segment_ids,
                                  kv_segment_ids=kv_segment_ids, q_slots=slots, kv_slots=kv_slots,
                                  backend=backend_name(cfg, rows), rows=rows, keys_transposed=True)
        elif cfg.attention == "nsa" and cache_nsa is not None:
            out, (k_cmp, v_cmp) = self.nsa(q, k.astype(dt), v.astype(dt), positions, segment_ids, cache_nsa)
            new_kv.update(k_cmp=k_cmp, v_cmp=v_cmp)
        elif cfg.attention == "nsa":
            out = self.nsa(q, k.astype(dt), v.astype(dt), positions, segment_ids)
        else:
            attend = document_attention if cfg.attention == "doc" else dense_attention
            out = attend(q, k.astype(dt), v.astype(dt), q_segment_ids=segment_ids,
                         kv_segment_ids=kv_segment_ids, q_slots=slots, kv_slots=kv_slots,
                         backend=backend_name(cfg, rows), rows=rows)
        o = jnp.einsum("BTNH,NHD->BTD", out, self.wo[...].astype(dt))
        if cfg.out_bias:
            o = o + self.bo[...].astype(dt)
        return adapted(self.lora, "o_proj", out, o, key), new_kv


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f, pd = cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype
        self.w_gate = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.w_up = _param(rngs, (d, f), ("embed", "mlp"), pd)
        self.w_down = _param(rngs, (f, d), ("mlp", "embed"), pd)
        embed, mlp = ((d, "embed"),), ((f, "mlp"),)
        self.lora = make_adapters(cfg, {"gate_proj": (embed, mlp), "up_proj": (embed, mlp),
                                        "down_proj": (mlp, embed)}, rngs=rngs)

    def __call__(self, x, dropout_key=None):
        dt, key = x.dtype, dropout_key
        gate = adapted(self.lora, "gate_proj", x,
                       jnp.einsum("BTD,DF->BTF", x, self.w_gate[...].astype(dt)), key)
        up = adapted(self.lora, "up_proj", x,
                     jnp.einsum("BTD,DF->BTF", x, self.w_up[...].astype(dt)), key)
        h = jax.nn.silu(gate) * up
        return adapted(self.lora, "down_proj", h,
                       jnp.einsum("BTF,FD->BTD", h, self.w_down[...].astype(dt)), key)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
        pd = cfg.param_dtype
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", param_dtype=pd, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", param_dtype=pd, rngs=rngs)
        self.sparse = is_moe_layer(cfg, layer)
        self.mlp = MoE(cfg, rngs=rngs) if self.sparse else MLP(cfg, rngs=rngs)

    def __call__(self, x, positions, segment_ids, slots, dropout_key=None, rows="segments",
                 **cache):
        """-> (x, new kv or None, router logits [N, E] or None)."""
        h, new_kv = self.attn(self.attn_norm(x), positions, segment_ids, slots, dropout_key,
                              rows=rows, **cache)
        x = x + h
        if self.sparse:
            h, router_logits = self.mlp(self.mlp_norm(x), segment_ids != 0)
            return x + h, new_kv, router_logits
        return x + self.mlp(self.mlp_norm(x), dropout_key), new_kv, None


class Decoder(nnx.Module):
    """`model(tokens) -> logits [B, T, V]`; with a cache, `(logits, new_cache)`; with
    `with_aux_loss`, `(logits, load-balancing loss)` (0 for a dense model). With
    `hidden_only`, the final-normed hidden states [B, T, D] take the logits' place;
    `model.logits(hidden)` finishes them (training scores only the target positions)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        v, d, pd = cfg.vocab_size, cfg.hidden_size, cfg.param_dtype
        check_lora(cfg.lora, cfg.tie_embeddings, any_sparse(cfg))
        self.config = cfg
        kind = lambda name: SavedParam if name in cfg.lora.modules_to_save else nnx.Param
        self.embed = _param(rngs, (v, d), ("vocab", "embed"), pd, kind=kind("embed_tokens"))
        self.layers = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(d, cfg.rms_norm_eps, "embed", param_dtype=pd, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (d, v), ("embed", "vocab"), pd, kind=kind("lm_head"))
        vocab, embed = ((v, "vocab"),), ((d, "embed"),)
        self.lora = make_adapters(cfg, {"embed_tokens": (vocab, embed),
                                        "lm_head": (embed, vocab)}, rngs=rngs)

    def __call__(
        self,
        tokens: jax.Array,  # [B, T] int
        positions: jax.Array | None = None,  # [B, T] RoPE positions; default 0..T-1
        segment_ids: jax.Array | None = None,  # [B, T]; packed documents, 0 = padding
        cache: KVCache | None = None,
        *,
        last_only: bool = False,  # logits of the last position only (prefill)
        with_aux_loss: bool = False,  # also return the MoE load-balancing loss (training)
        hidden_only: bool = False,  # final-normed hidden states instead of logits
        # How the rows are laid out (static; the attention kernels it allows differ):
        # "causal": one sequence per row from slot 0, then padding (`jaxagent.steps.pack`);
        # "segments": any segment ids (packed documents, shared prompts). A cached call is
        # "cached"; without segment_ids the rows are causal.
        rows: Literal["causal", "segments"] = "segments",
        dropout_key: jax.Array | None = None,  # training passes: LoRA dropout's key
    ):
        cfg = self.config
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids, rows = jnp.ones((b, t), jnp.int32), "causal"
        slots = jnp.arange(t, dtype=jnp.int32)[None, :]
        if cache is not None:
            slots = slots + cache.index
            cache_segment_ids = jax.lax.dynamic_update_slice(
                cache.segment_ids, segment_ids.astype(jnp.int32), (0, cache.index)
            )
        slots = jnp.broadcast_to(slots, (b, t))
        if dropout_key is not None and cache is not None:
            raise ValueError("dropout_key is for training passes, not cached decoding")
        if cache is not None and cache.slot_of is not None:
            # NSA: each real token's position now lives at its slot (padding writes nowhere)
            where = jnp.where(segment_ids != 0, positions, cache.size)
            slot_of = cache.slot_of.at[jnp.arange(b)[:, None], where].set(slots, mode="drop")

        x = jnp.take(self.embed[...], tokens, axis=0).astype(cfg.dtype)
        if "embed_tokens" in self.lora:
            x = x + self.lora["embed_tokens"].lookup(tokens, cfg.dtype)
        x = constrain(x, _BTD)
        new_kv, router_logits = [], []
        run = _remat(lambda layer, *args, **kw: layer(*args, rows=rows, **kw), cfg.remat, cache is None)
        for i, layer in enumerate(self.layers):
            kw = {}
            if cache is not None:
                kw = dict(cache_kv=(cache.k[i], cache.v[i]), cache_segment_ids=cache_segment_ids,
                          cache_index=cache.index)
                if cache.slot_of is not None:
                    kw["cache_nsa"] = (cache.k_cmp[i], cache.v_cmp[i], slot_of)
                if cache.k_t is not None:
                    kw["cache_k_t"] = cache.k_t[i]
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
            x, kv, layer_router_logits = run(layer, x, positions, segment_ids, slots, key, **kw)
            x = constrain(x, _BTD)  # activations pinned at layer boundaries
            if layer_router_logits is not None:
                router_logits.append(layer_router_logits)
            if kv is not None:
                new_kv.append(kv)
        x = self.final_norm(x[:, -1:] if last_only else x)
        head_key = None if dropout_key is None else jax.random.fold_in(dropout_key, cfg.num_layers)
        logits = x if hidden_only else self.logits(x, head_key)
        if with_aux_loss:
            if cache is not None:
                raise ValueError("with_aux_loss is for training passes, not cached decoding")
            aux = (load_balancing_loss(router_logits, cfg.num_experts_per_tok,
                                       segment_ids.reshape(-1) != 0)
                   if router_logits else jnp.zeros((), jnp.float32))
            return logits, aux
        if cache is None:
            return logits
        per_layer = {name: [kv[name] for kv in new_kv] for name in new_kv[0]}  # k, v[, k_cmp, v_cmp][, k_t]
        if cache.slot_of is not None:
            per_layer["slot_of"] = slot_of
        return logits, KVCache(segment_ids=cache_segment_ids, index=cache.index + t, **per_layer)


    def logits(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """Final-normed hidden states [B, T, D] -> float32 logits [B, T, V] (`dropout_key`: as
        the model's call, for an adapted head)."""
        if self.config.tie_embeddings:
            logits = jnp.einsum("BTD,VD->BTV", x, self.embed[...].astype(x.dtype))
        else:
            logits = adapted(self.lora, "lm_head", x,
                             jnp.einsum("BTD,DV->BTV", x, self.lm_head[...].astype(x.dtype)),
                             dropout_key)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))


_REMAT_POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                   "full": jax.checkpoint_policies.nothing_saveable}


def _remat(run, remat: str, training: bool):
    """A layer call that saves only what `model.remat` keeps for the backward pass (training
    passes only: cached decoding has no backward)."""
    if remat == "none" or not training:
        return run
    return nnx.remat(run, policy=_REMAT_POLICIES[remat])


def backend_name(cfg: ModelConfig, rows: str, platform: str | None = None,
                 devices: int | None = None) -> str:
    """The backend ("xla", "pallas", "cudnn" or "splash") a dense or document-attention model
    runs on `rows` (``pallas_kernels.attention.ROWS``) on `platform` (default: JAX's) over
    `devices` (default: the abstract mesh's)."""
    try:
        return resolve_backend(cfg.attention, cfg.attention_backend, rows=rows, platform=platform,
                               dtype=cfg.dtype, devices=devices)
    except ValueError as e:
        raise ValueError(f"model.attention_backend: {e}") from None


def sees_all_segments(cfg: ModelConfig) -> bool:
    """Whether the model honours negative ("sees all") segment ids: shared-prompt packing and
    document prompts need it; both backends of dense and document attention do, NSA's branches
    do not read segment ids."""
    return cfg.attention != "nsa"


def init_model(cfg: ModelConfig, seed: int = 0, shardings=None) -> Decoder:
    """A randomly initialised decoder (one compiled program, not one dispatch per parameter).

    The seed is the program's argument, not a constant in it: every seed of one config runs the
    same program (one compile, then the persistent compilation cache where one is set).
    `shardings` (weights -> their shardings, e.g. `sharding.rules.shardings` on a mesh): each
    device makes its own blocks, so none holds the whole model; on a GPU the host makes the
    weights and each device receives its blocks."""

    def build(key):
        return Decoder(cfg, rngs=nnx.Rngs(params=key))

    key = jax.random.key(seed)
    host = _host() if jax.default_backend() == "gpu" else None
    if host is None and shardings is None:
        return nnx.jit(build)(key)
    if host is None:
        graphdef, abstract = nnx.split(nnx.eval_shape(lambda: build(key)))
        make = jax.jit(lambda k: nnx.split(build(k))[1], out_shardings=shardings(abstract))
        return nnx.merge(graphdef, make(key))
    # XLA:GPU took 3m12s to compile this for a 24-layer 0.5B model on an H100 (XLA:CPU ~10 s):
    # initialise on the host, then copy to the device (or each device its blocks).
    with jax.default_device(host):
        graphdef, state = nnx.split(nnx.jit(build)(key))
    return nnx.merge(graphdef, jax.device_put(state, jax.devices()[0] if shardings is None
                                              else shardings(state)))


def _host() -> jax.Device | None:
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
        return None


def compute_weights(params, cfg: ModelConfig):
    """`params` with every floating leaf in the compute dtype (`cfg.dtype`). Every layer casts
    its weights to that dtype before use, so a model run on these gives the same numbers as on
    float32 masters; the sampler keeps this copy (half the bytes to publish and to read per
    decode step)."""
    dt = jnp.dtype(cfg.dtype)
    return jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        params)


def logical_axes(model: nnx.Module) -> dict:
    """{parameter path: logical axis names}, for `sharding/` to map onto a mesh."""
    return {
        path: var.get_metadata()["logical_axes"]
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }
