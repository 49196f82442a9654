"""Segment-masked attention in XLA: the production path of dense and document attention where
the Pallas kernel (``kernel.py``) does not run, with the decode-step forms XLA:CPU runs fastest.
Same contract as ``doc_attention`` (``pallas_kernels.attention`` describes it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.doc_attention.kernel import visible


# Queries per chunk of a long call: a whole row's float32 scores [B, K, G, T, S] and the
# probabilities its backward keeps are quadratic in length. For 4 rows of 3,072 tokens at the
# tiny agent model's heads, one layer's forward and backward took 2,352 MiB of XLA:CPU
# temporaries whole and 211 MiB in chunks of 256 (benchmarks/attention_backends.py). On CPU
# the chunk's scores should also stay in the core's caches: chunks of 32 ran that pass 2.5x
# faster than 256, a prefill of 8 rows x 512 tokens onto 2,048 cached slots 3.3x, and were
# within 10% of the best size at every shape tried (2-core Xeon, 2 MiB L2 a core, 2026-11-29).
# Accelerators keep 256: their matrix units want whole tiles.
def default_query_chunk(platform: str | None = None) -> int:
    """Queries per chunk on `platform` (default: JAX's default backend)."""
    return 32 if (platform or jax.default_backend()) == "cpu" else 256


# Bands of query chunks an uncached call's causal rows are split into (see xla_attention).
CAUSAL_BANDS = 8


def xla_attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_slots, kv_slots,
                  query_chunk: int | None = None, slots_are_indices: bool = False):
    """Plain einsums, softmax in float32; GQA without repeating K/V. More than `query_chunk`
    queries (None: `default_query_chunk()`) run in chunks of that many (a scan), each
    recomputed in the backward pass, so no pass holds more than one chunk's scores; 0 attends
    all queries at once. `slots_are_indices`: every row's slots are its token indices 0..T-1
    for queries and keys alike (an uncached call, S = T), so no key after a chunk's last query
    is visible to it: the chunks run in `CAUSAL_BANDS` bands, each reading the keys up to its
    last query only (~56% of the scores of a whole row)."""
    if query_chunk is None:
        query_chunk = default_query_chunk()
    t, s = q.shape[1], k.shape[2]
    if slots_are_indices and s != t:
        raise ValueError(f"slots_are_indices: {t} queries but {s} keys (a cached call?)")
    if t == 1:
        return _decode_attention(q, k, v, visible(q_segment_ids, kv_segment_ids, q_slots, kv_slots))
    if not query_chunk or t <= query_chunk:
        return _attend(q, k, v, q_segment_ids, kv_segment_ids, q_slots, kv_slots)
    n_chunks = -(-t // query_chunk)
    size = -(-t // n_chunks)  # chunks of equal size, at most query_chunk: little padding
    pad = n_chunks * size - t  # padding queries (segment 0) see nothing and are cut off

    def chunks(x):  # [B, T, ...] -> [n_chunks, B, size, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(x.shape[0], n_chunks, size, *x.shape[2:]).swapaxes(0, 1)

    def attend_keys(end):  # the chunks' attention to keys [0, end)
        return jax.checkpoint(lambda xs: _attend(xs[0], k[:, :, :end], v[:, :, :end], xs[1],
                                                 kv_segment_ids[:, :end], xs[2], kv_slots[:, :end]))

    xs = (chunks(q), chunks(q_segment_ids), chunks(q_slots))
    if not slots_are_indices:
        out = jax.lax.map(attend_keys(s), xs)
    else:
        per = -(-n_chunks // CAUSAL_BANDS)  # chunks per band
        out = jnp.concatenate([
            jax.lax.map(attend_keys(min((a + per) * size, s)),
                        jax.tree.map(lambda x: x[a:a + per], xs))
            for a in range(0, n_chunks, per)])
    return out.swapaxes(0, 1).reshape(q.shape[0], -1, *q.shape[2:])[:, :t]


def _attend(q, k, v, q_segment_ids, kv_segment_ids, q_slots, kv_slots):
    b, t, n, h = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("BTKGH,BKSH->BKGTS", q, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    mask = visible(q_segment_ids, kv_segment_ids, q_slots, kv_slots)[:, None, None]
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
