"""Library flash kernels for causal rows: cuDNN's fused attention (GPU) and Pallas splash
attention (TPU). Both take the contract of ``pallas_kernels.attention.dense_attention``
restricted to self-attention over whole rows (T == S, query and key slots 0..T-1).

cuDNN describes its mask by a causal flag and per-row lengths, so it runs only "causal" rows:
one sequence from slot 0, then padding (segment ids 1...1 0...0, as ``jaxagent.steps.pack``
lays out). Splash compares segment ids for equality, so it also runs rows of packed positive
documents; neither expresses "sees all" (negative) segments. A padding query sees nothing in
our contract and gives 0; both kernels give it some average instead, zeroed here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

SPLASH_BLOCK = 512  # largest splash block; multiples of 128 (TPU lanes)


def cudnn_attention(q, k, v, *, q_segment_ids, kv_segment_ids, implementation="cudnn"):
    """q [B, T, N, H], k and v [B, K, T, H], segment ids [B, T] of causal rows -> [B, T, N, H]
    through ``jax.nn.dot_product_attention``: its causal flag and the rows' lengths (count of
    non-zero segment ids), no mask array. `implementation="xla"` builds the same call on jax's
    XLA path (how CPU tests check the arguments)."""
    _check_self_attention(q, k)
    lengths = lambda seg: jnp.sum(seg != 0, axis=1, dtype=jnp.int32)  # noqa: E731
    out = jax.nn.dot_product_attention(
        q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), is_causal=True,
        query_seq_lengths=lengths(q_segment_ids), key_value_seq_lengths=lengths(kv_segment_ids),
        implementation=implementation)
    return _zero_padding_queries(out, q_segment_ids)


def splash_attention(q, k, v, *, q_segment_ids, kv_segment_ids, interpret=False):
    """q [B, T, N, H], k and v [B, K, T, H], segment ids [B, T] (causal rows or packed positive
    documents) -> [B, T, N, H]: one splash MQA kernel per (row, kv head) over its G query
    heads. T is padded to a multiple of the block (padding is segment 0)."""
    _check_self_attention(q, k)
    b, t, n, h = q.shape
    kv_heads = k.shape[1]
    g = n // kv_heads
    block = min(SPLASH_BLOCK, -(-t // 128) * 128)
    padded = -(-t // block) * block
    grow = lambda x, axis: jnp.pad(x, [(0, padded - t) if a == axis else (0, 0)  # noqa: E731
                                       for a in range(x.ndim)])
    q_ = grow((q * h**-0.5).reshape(b, t, kv_heads, g, h).transpose(0, 2, 3, 1, 4), 3)
    k_, v_ = grow(k, 2), grow(v, 2)
    segments = splash.SegmentIds(q=grow(q_segment_ids.astype(jnp.int32), 1),
                                 kv=grow(kv_segment_ids.astype(jnp.int32), 1))
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((padded, padded))] * g)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    kernel = splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
    per_head = jax.vmap(lambda qg, kh, vh, seg: kernel(qg, kh, vh, segment_ids=seg),
                        in_axes=(0, 0, 0, None))
    out = jax.vmap(per_head)(q_, k_, v_, segments)  # [B, K, G, T', H]
    out = out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)
    return _zero_padding_queries(out, q_segment_ids)


def _check_self_attention(q, k):
    if q.shape[1] != k.shape[2]:
        raise ValueError(f"causal-row kernels attend a row to itself: {q.shape[1]} queries, "
                         f"{k.shape[2]} keys")


def _zero_padding_queries(out, q_segment_ids):
    return jnp.where((q_segment_ids != 0)[:, :, None, None], out, 0).astype(out.dtype)
