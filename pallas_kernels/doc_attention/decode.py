"""A decode step's attention against a KV cache: split-K flash decoding, GPU-style Pallas
(Triton lowering; `interpret=True` on CPU).

Letters: B batch, N query heads, K kv heads, G = N // K query heads per kv head (Gp: padded),
S cache slots, H head dim, C key chunks per row.

One query per row reads the whole cache, so a decode step is bound by reading K and V. XLA's
multiply-and-reduce form took 34 µs a layer at batch 64 on an H200 for 21 MB of K and V (5.8 µs
at its bandwidth; docs/benchmarks.md, third lease). Here one program per (row, kv head, key
chunk) takes the group's G query heads as one [Gp, H] tile (zero rows up to Triton's 16-row
dot), so K and V are read once per kv head rather than once per query head, and it walks its
chunk in blocks of `block_k` with an online softmax, from the row's first visible slot to its
last: left padding and the cache's empty tail are not read. The chunks' unnormalised partials
(acc, running max m, sum l) are merged by log-sum-exp outside the kernel; chunks split the
rows' keys so that B x K x C programs fill the GPU at small batch.

Masking is exact per slot: `visible` (kernel.py) for the one query of each row, so left-padded
prompts, gapped multi-turn caches and negative ("sees all") segments hold as in the training
kernel. A row that sees nothing gives 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.doc_attention.kernel import visible
from pallas_kernels.nsa._index import online_softmax, pad_axis

MIN_DOT_ROWS = 16  # Triton's smallest dot tile
MIN_BLOCK = 16  # the smallest key block (padded slots carry segment 0: nothing sees them)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_k: int = 128  # slots per step of a program's loop (at most; a power of two dividing S)
    programs: int = 264  # chunks are added until B x K x C reaches this (2 per H100/H200 SM)
    num_warps: int = 4
    num_stages: int = 2


def _kernel(bounds_ref, q_ref, k_ref, v_ref, mask_ref, acc_ref, m_ref, l_ref, *, scale,
            block_k, blocks_per_chunk):
    chunk = pl.program_id(2)
    first = jnp.maximum(bounds_ref[0] // block_k, chunk * blocks_per_chunk)
    last = jnp.minimum(bounds_ref[1] // block_k + 1, (chunk + 1) * blocks_per_chunk)
    q = q_ref[...]  # [Gp, H]

    def body(j, carry):
        m, l, acc = carry
        ks = pl.ds(j * block_k, block_k)
        ok = (mask_ref[ks] != 0)[None, :]
        s = jnp.where(ok, plgpu.dot(q, k_ref[ks, :].T) * scale, -jnp.inf)  # [Gp, bk] float32
        return online_softmax(m, l, acc, s, ok,
                              lambda p: plgpu.dot(p.astype(v_ref.dtype), v_ref[ks, :]))

    gp, h = q.shape
    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32),
            jnp.zeros((gp, h), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, last, body, init)
    m_ref[...], l_ref[...], acc_ref[...] = m, l, acc


def _geometry(b, kv_heads, s, block_sizes):
    """(block_k, chunks): the largest power-of-two block up to `block_sizes.block_k` that divides
    S (a multiple of 16), and enough chunks (dividing S's blocks) for B x K x C to reach
    `block_sizes.programs`."""
    block_k = block_sizes.block_k
    while s % block_k:
        block_k //= 2
    blocks = s // block_k
    want = min(blocks, -(-block_sizes.programs // (b * kv_heads)))
    chunks = max(c for c in range(1, want + 1) if blocks % c == 0)
    return block_k, chunks


def decode_attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_slots, kv_slots,
                     block_sizes: BlockSizes | None = None, scale: float | None = None,
                     interpret: bool = False):
    """q [B, 1, N, H], k/v [B, K, S, H] (the cache), ids and slots [B, 1] and [B, S]
    -> [B, 1, N, H]: the contract of `pallas_kernels.attention.dense_attention` for one query
    per row. The reference is `doc_attention_reference` (same contract). H should be a power of
    two of at least 16 (Triton's tiles); S is padded to a multiple of 16 (a copy of the cache:
    the sampler's buckets keep S a multiple of 64)."""
    b, t, n, h = q.shape
    kv_heads = k.shape[1]
    if t != 1:
        raise ValueError(f"decode attention takes one query per row, got {t}")
    if n % kv_heads:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({kv_heads})")
    k, v = pad_axis(k, 2, MIN_BLOCK), pad_axis(v, 2, MIN_BLOCK)
    kv_segment_ids, kv_slots = pad_axis(kv_segment_ids, 1, MIN_BLOCK), pad_axis(kv_slots, 1, MIN_BLOCK)
    s = k.shape[2]
    params = block_sizes or BlockSizes()
    block_k, chunks = _geometry(b, kv_heads, s, params)
    g = n // kv_heads
    gp = max(MIN_DOT_ROWS, pl.next_power_of_2(g))
    qg = pad_axis(q.reshape(b, kv_heads, g, h), 2, gp)  # zero rows: exact, sliced off below
    mask = visible(q_segment_ids, kv_segment_ids, q_slots, kv_slots)[:, 0]  # [B, S]
    slot = jnp.arange(s, dtype=jnp.int32)
    bounds = jnp.stack([jnp.min(jnp.where(mask, slot, s), -1),
                        jnp.max(jnp.where(mask, slot, -1), -1)], -1).astype(jnp.int32)  # [B, 2]
    kernel = functools.partial(_kernel, scale=h**-0.5 if scale is None else scale,
                               block_k=block_k, blocks_per_chunk=s // block_k // chunks)
    row, head = lambda i, j, c: (i, j, 0, 0), lambda i, j, c: (i, j, c, 0)
    acc, m, l = pl.pallas_call(
        kernel,
        grid=(b, kv_heads, chunks),
        in_specs=[
            pl.BlockSpec((None, 2), lambda i, j, c: (i, 0)),
            pl.BlockSpec((None, None, gp, h), row),
            pl.BlockSpec((None, None, s, h), row),
            pl.BlockSpec((None, None, s, h), row),
            pl.BlockSpec((None, s), lambda i, j, c: (i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, h), lambda i, j, c: (i, j, c, 0, 0)),
            pl.BlockSpec((None, None, None, gp), head),
            pl.BlockSpec((None, None, None, gp), head),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, kv_heads, chunks, gp, h), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv_heads, chunks, gp), jnp.float32),
                   jax.ShapeDtypeStruct((b, kv_heads, chunks, gp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=params.num_warps,
                                             num_stages=params.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(bounds, qg, k, v, mask.astype(jnp.int32))
    # Merge the chunks: each chunk's sums rescaled to the row's overall max.
    top = m.max(2, keepdims=True)
    weight = jnp.exp(m - jnp.where(top == -jnp.inf, 0.0, top))  # [B, K, C, Gp]; 0 for empty chunks
    total = (l * weight).sum(2)
    out = (acc * weight[..., None]).sum(2) / jnp.where(total > 0, total, 1.0)[..., None]
    return out[:, :, :g].reshape(b, 1, n, h).astype(q.dtype)
