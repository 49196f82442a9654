"""Attention with pluggable backends.

Letters: B batch, T query time, S key time, N query heads, K kv heads, G = N // K query heads
per kv head, H head dim.

Keys and values are laid out [B, K, S, H], the KV cache's layout: a decode step then reads
each (batch, kv head) slice contiguously instead of transposing the whole cache.

Masking is described, not materialised, so that kernels can skip whole blocks: a query may
see a key iff the key's slot is not after the query's slot (causal) and either both carry the
same segment id, or the query's segment is a "sees all" segment (negative id) and the key's is
a document (positive id). Segment id 0 marks padding and empty cache slots. Slots are token
indices in the (packed or cached) sequence, not RoPE positions, which may restart per document.

Negative segments express one row of shared context: documents `1, 2, ...` attend within
themselves only, and each negative segment attends to all documents and to itself, not to the
other negative segments. A GRPO group packed as `[prompt, completion_1, ..., completion_G]`
(prompt id 1, completion i id -i) thus computes the prompt once; a document-level prompt
(documents 1..n, final section -1) lets each document's KV be computed alone.
"""

from __future__ import annotations

from typing import Callable, Protocol

import jax
import jax.numpy as jnp

from pallas_kernels.doc_attention import doc_attention, visible


class AttentionFn(Protocol):
    def __call__(
        self,
        q: jax.Array,  # [B, T, N, H]
        k: jax.Array,  # [B, K, S, H]
        v: jax.Array,  # [B, K, S, H]
        *,
        q_segment_ids: jax.Array,  # [B, T] int32
        kv_segment_ids: jax.Array,  # [B, S] int32
        q_slots: jax.Array,  # [B, T] int32
        kv_slots: jax.Array,  # [B, S] int32
    ) -> jax.Array:  # [B, T, N, H]
        ...


def attention_mask(q_segment_ids, kv_segment_ids, q_slots, kv_slots) -> jax.Array:
    """[B, T, S] bool: causal, and the same non-padding segment or a document seen by a
    "sees all" (negative) segment."""
    return visible(q_segment_ids, kv_segment_ids, q_slots, kv_slots)


def xla_attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_slots, kv_slots):
    """Reference backend: plain einsums, softmax in float32; GQA without repeating K/V."""
    b, t, n, h = q.shape
    kv_heads = k.shape[1]
    if t == 1:
        return _decode_attention(q, k, v, attention_mask(q_segment_ids, kv_segment_ids, q_slots,
                                                         kv_slots))
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("BTKGH,BKSH->BKGTS", q, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    mask = attention_mask(q_segment_ids, kv_segment_ids, q_slots, kv_slots)[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    # A fully masked row (a padding query) would average all values; zero it instead.
    probs = jnp.where(mask.any(-1, keepdims=True), probs, 0.0)
    out = jnp.einsum("BKGTS,BKSH->BTKGH", probs.astype(v.dtype), v)
    return out.reshape(b, t, n, h)


def _decode_attention(q, k, v, mask):
    """One query per row (a decode step), mask [B, 1, S]. q.K is written as multiply-and-reduce:
    XLA:CPU vectorises that fusion better than its dot with a single query."""
    n = q.shape[2]
    q = _decode_queries(q, k.shape[1])
    scores = jnp.sum(q[:, :, :, None, :] * k[:, :, None, :, :].astype(jnp.float32), axis=-1)  # [B,K,G,S]
    return _decode_mix(scores, v, mask, n)


def decode_attention_keys_transposed(q, k_t, v, mask):
    """``_decode_attention`` with the keys laid out [B, K, H, S] (the sampler keeps such a copy
    during decoding): q.K then reduces over H with S the vectorised minor axis, 3-4x faster on
    XLA:CPU than reducing the minor H of [B, K, S, H]."""
    q = _decode_queries(q, k_t.shape[1])
    scores = jnp.sum(q[..., :, None] * k_t[:, :, None].astype(jnp.float32), axis=-2)
    return _decode_mix(scores, v, mask, q.shape[1] * q.shape[2])


def _decode_queries(q, kv_heads):
    """[B, 1, N, H] -> scaled float32 [B, K, G, H]."""
    b, _, n, h = q.shape
    return q.reshape(b, kv_heads, n // kv_heads, h).astype(jnp.float32) * (h**-0.5)


def _decode_mix(scores, v, mask, n):
    """Masked softmax of scores [B, K, G, S] (one max, one exp, one sum) and p.V as
    multiply-and-reduce: XLA:CPU's dot for p.V with a single query ran 2-3x slower (the
    sampler's step time halved at 512 new tokens). -> [B, 1, N, H]."""
    f32 = jnp.float32
    mask = mask[:, None]  # [B, 1, 1, S]
    scores = jnp.where(mask, scores, jnp.finfo(f32).min)
    weights = jnp.where(mask, jnp.exp(scores - scores.max(-1, keepdims=True)), 0.0)
    total = weights.sum(-1, keepdims=True)
    out = jnp.sum(weights[..., None] * v[:, :, None].astype(f32), axis=-2)  # [B, K, G, H]
    # A query that sees nothing (total 0) gives zeros, as in the general path.
    out = out / jnp.where(total > 0, total, 1.0)
    return out.reshape(v.shape[0], 1, n, v.shape[-1]).astype(v.dtype)


def doc_kernel_attention(q, k, v, **segments):
    """The block-sparse Pallas kernel (pallas_kernels.doc_attention); interpreted on CPU."""
    return doc_attention(q, k, v, **segments, interpret=jax.default_backend() == "cpu")


BACKENDS: dict[str, AttentionFn] = {"xla": xla_attention, "doc": doc_kernel_attention}
_SEES_ALL = {"xla", "doc"}  # backends that implement negative ("sees all") segments


def register_backend(name: str, fn: AttentionFn, *, sees_all_segments: bool = False) -> None:
    """Kernel packages add their backends here (e.g. "nsa", "flash")."""
    BACKENDS[name] = fn
    if sees_all_segments:
        _SEES_ALL.add(name)


def supports_sees_all(name: str) -> bool:
    """Whether backend `name` implements negative segments (shared-prompt packing)."""
    return name in _SEES_ALL


def get_backend(name: str) -> Callable[..., jax.Array]:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"model.attention_backend: unknown backend {name!r}; known: {sorted(BACKENDS)}"
        ) from None
