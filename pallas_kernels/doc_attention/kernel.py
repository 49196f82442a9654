"""Block-sparse flash attention over segments: documents, shared prompts, padding.

Letters: B batch, T query time, S key time, N query heads, K kv heads, G = N // K,
H head dim, I query blocks, J key blocks.

The mask is described, not materialised (as in `pallas_kernels.attention`): query t sees key
s iff slot[s] <= slot[t] (causal) and either seg[t] == seg[s] != 0, or seg[t] < 0 < seg[s]
(a "sees all" segment reads every document). Documents attend within themselves; the final
section of a document-level prompt (or each completion of a shared-prompt GRPO group) reads
all documents. Before the kernels run, `block_visibility` bounds each (query block, key block)
pair from per-block ranges of segment ids and slots; a pair that cannot hold a visible entry
is skipped entirely, so documents cost their own length squared, not the row's.

Kernels (Pallas, GPU/Triton-style; every one also runs with `interpret=True` on CPU):
  forward   grid (B, N, I): online softmax over the visible key blocks; writes out and the
            log-sum-exp per query.
  dq        grid (B, N, I): recomputes p from the log-sum-exp, dq = scale * sum ds k.
  dk, dv    grid (B, N, J): the key block's visible query blocks; per query head, then
            summed over the G heads of a kv group outside the kernel (deterministic, no atomics).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_BIG = 1e30  # log-sum-exp of a query that sees nothing: exp(s - _BIG) = 0 in the backward
# The Triton lowering, named: a block of a whole row of keys is a pointer there, sliced per key
# block, while Mosaic GPU (the default lowering of some jax versions) stages whole blocks in
# shared memory (540 KB for a 960-slot float32 cache, over Hopper's 227 KB).
_TRITON = plgpu.CompilerParams()


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 64
    block_k: int = 64


# ---------------------------------------------------------------------------------------------
# Reference and masks.


def visible(q_seg, kv_seg, q_slots, kv_slots):
    """[..., T, S] bool: the visibility rule above, entry by entry."""
    q, kv = q_seg[..., :, None], kv_seg[..., None, :]
    same_or_document = (q == kv) | ((q < 0) & (kv > 0))
    return same_or_document & (kv != 0) & (kv_slots[..., None, :] <= q_slots[..., :, None])


def doc_attention_reference(q, k, v, q_segment_ids, kv_segment_ids, q_slots, kv_slots, *,
                            scale=None):
    """Plain JAX: q [B,T,N,H], k/v [B,K,S,H] -> [B,T,N,H]; a query that sees nothing gives 0."""
    b, t, n, h = q.shape
    kh = k.shape[1]
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kh, n // kh, h)
    # at least float32; a float64 reference stays float64 (cuBLAS has no f64 x f64 -> f32 GEMM)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    s = jnp.einsum("BTKGH,BKSH->BKGTS", qg, k, preferred_element_type=acc) * scale
    mask = visible(q_segment_ids, kv_segment_ids, q_slots, kv_slots)[:, None, None]
    p = jax.nn.softmax(jnp.where(mask, s, MASK_VALUE), axis=-1)
    p = jnp.where(mask, p, 0.0)
    out = jnp.einsum("BKGTS,BKSH->BTKGH", p.astype(v.dtype), v)
    return out.reshape(b, t, n, h)


def _block_ranges(seg, slots, block):
    """Per block of `block` tokens: (lo+, hi+, lo-, hi-, slot lo, slot hi) [B, nblocks]."""
    b, length = seg.shape
    seg, slots = seg.reshape(b, length // block, block), slots.reshape(b, length // block, block)
    big = jnp.iinfo(jnp.int32).max
    pos, neg = seg > 0, seg < 0
    real = seg != 0
    return (jnp.where(pos, seg, big).min(-1), jnp.where(pos, seg, -big).max(-1),
            jnp.where(neg, seg, big).min(-1), jnp.where(neg, seg, -big).max(-1),
            jnp.where(real, slots, big).min(-1), jnp.where(real, slots, -big).max(-1))


def block_visibility(q_seg, kv_seg, q_slots, kv_slots, block_q, block_k):
    """[B, I, J] int32: 1 where the (query block, key block) pair may hold a visible entry.

    Conservative (ranges, not sets), exact per entry inside the kernel. Costs O(I * J), not
    O(T * S). Padding-only blocks have empty ranges and are never visible.
    """
    qp_lo, qp_hi, qn_lo, qn_hi, _, q_slot_hi = (x[:, :, None] for x in
                                                _block_ranges(q_seg, q_slots, block_q))
    kp_lo, kp_hi, kn_lo, kn_hi, k_slot_lo, _ = (x[:, None, :] for x in
                                                _block_ranges(kv_seg, kv_slots, block_k))
    overlap = lambda lo1, hi1, lo2, hi2: (lo1 <= hi2) & (lo2 <= hi1)  # noqa: E731
    same = overlap(qp_lo, qp_hi, kp_lo, kp_hi) | overlap(qn_lo, qn_hi, kn_lo, kn_hi)
    reads_documents = (qn_lo <= qn_hi) & (kp_lo <= kp_hi)
    return ((same | reads_documents) & (k_slot_lo <= q_slot_hi)).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Kernels. Refs hold one (batch, head) slice: q/o/do [bq, H], k/v [S, H], segments/slots as
# vectors, visibility as the row (or column) of this block.


def _dot(a, b):
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _scores(q, k, qseg, kseg, qslot, kslot, scale):
    s = _dot(q, k.T) * scale
    mask = visible(qseg, kseg, qslot, kslot)
    return jnp.where(mask, s, MASK_VALUE), mask


def _fwd_kernel(vis_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, qslot_ref, kslot_ref,
                o_ref, lse_ref, *, scale, block_k):
    q = q_ref[...]
    qseg, qslot = qseg_ref[...], qslot_ref[...]
    bq, h = q.shape

    def body(j, carry):
        def visit(carry):
            acc, m, l = carry
            ks = pl.ds(j * block_k, block_k)
            s, mask = _scores(q, k_ref[ks, :], qseg, kseg_ref[ks], qslot, kslot_ref[ks], scale)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
            correction = jnp.exp(m - m_new)
            acc = acc * correction[:, None] + _dot(p.astype(v_ref.dtype), v_ref[ks, :])
            return acc, m_new, l * correction + p.sum(-1)

        return lax.cond(vis_ref[j] != 0, visit, lambda c: c, carry)

    init = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(0, vis_ref.shape[0], body, init)
    seen = l > 0
    o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None],
                           0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), _BIG)


def _dq_kernel(vis_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, qslot_ref, kslot_ref,
               do_ref, lse_ref, delta_ref, dq_ref, *, scale, block_k):
    q, do = q_ref[...], do_ref[...]
    qseg, qslot = qseg_ref[...], qslot_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(j, dq):
        def visit(dq):
            ks = pl.ds(j * block_k, block_k)
            k = k_ref[ks, :]
            s, mask = _scores(q, k, qseg, kseg_ref[ks], qslot, kslot_ref[ks], scale)
            p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
            dp = _dot(do, v_ref[ks, :].T)
            ds = p * (dp - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k)

        return lax.cond(vis_ref[j] != 0, visit, lambda x: x, dq)

    dq = lax.fori_loop(0, vis_ref.shape[0], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(vis_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, qslot_ref, kslot_ref,
                do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, scale, block_q):
    k, v = k_ref[...], v_ref[...]
    kseg, kslot = kseg_ref[...], kslot_ref[...]

    def body(i, carry):
        def visit(carry):
            dk, dv = carry
            qs = pl.ds(i * block_q, block_q)
            q, do = q_ref[qs, :], do_ref[qs, :]
            s, mask = _scores(q, k, qseg_ref[qs], kseg, qslot_ref[qs], kslot, scale)
            p = jnp.where(mask, jnp.exp(s - lse_ref[qs][:, None]), 0.0)
            dv = dv + _dot(p.astype(do.dtype).T, do)
            dp = _dot(do, v.T)
            ds = p * (dp - delta_ref[qs][:, None])
            return dk + _dot(ds.astype(q.dtype).T, q), dv

        return lax.cond(vis_ref[i] != 0, visit, lambda c: c, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, vis_ref.shape[0], body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers. Kernel layout: q/o [B, N, T, H], k/v [B, K, S, H] (T, S padded to the
# block sizes with segment 0, which nothing sees).


def _specs(n, kv_heads, t, s, h, bq, bk, *, grid_over):
    """BlockSpecs for (vis, q, k, v, qseg, kseg, qslot, kslot[, do, lse, delta])."""
    g = n // kv_heads
    if grid_over == "q":  # grid (B, N, I): one query block, every key
        qmap, kmap = (lambda b, h_, i: (b, h_, i, 0)), (lambda b, h_, i: (b, h_ // g, 0, 0))
        q_block, k_block = (None, None, bq, h), (None, None, s, h)
        vis = pl.BlockSpec((None, None, s // bk), lambda b, h_, i: (b, i, 0))
        qvec = pl.BlockSpec((None, bq), lambda b, h_, i: (b, i))
        kvec = pl.BlockSpec((None, s), lambda b, h_, i: (b, 0))
        row = pl.BlockSpec((None, None, bq), lambda b, h_, i: (b, h_, i))
    else:  # grid (B, N, J): one key block, every query
        qmap, kmap = (lambda b, h_, j: (b, h_, 0, 0)), (lambda b, h_, j: (b, h_ // g, j, 0))
        q_block, k_block = (None, None, t, h), (None, None, bk, h)
        vis = pl.BlockSpec((None, None, t // bq), lambda b, h_, j: (b, j, 0))
        qvec = pl.BlockSpec((None, t), lambda b, h_, j: (b, 0))
        kvec = pl.BlockSpec((None, bk), lambda b, h_, j: (b, j))
        row = pl.BlockSpec((None, None, t), lambda b, h_, j: (b, h_, 0))
    qs, ks = pl.BlockSpec(q_block, qmap), pl.BlockSpec(k_block, kmap)
    return vis, qs, ks, ks, qvec, kvec, qvec, kvec, qs, row, row


def _pad(x, axis, multiple):
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _doc_attention(q, k, v, q_seg, kv_seg, q_slots, kv_slots, scale, block_sizes, interpret):
    return _forward(q, k, v, q_seg, kv_seg, q_slots, kv_slots, scale, block_sizes, interpret)[0]


def _forward(q, k, v, q_seg, kv_seg, q_slots, kv_slots, scale, block_sizes, interpret):
    b, n, t, h = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    bq, bk = block_sizes.block_q, block_sizes.block_k
    vis = block_visibility(q_seg, kv_seg, q_slots, kv_slots, bq, bk)
    specs = _specs(n, kv_heads, t, s, h, bq, bk, grid_over="q")
    out, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=scale, block_k=bk),
        grid=(b, n, t // bq),
        in_specs=list(specs[:8]),
        out_specs=[specs[1], specs[9]],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        compiler_params=_TRITON,
        interpret=interpret,
        name="doc_attention_fwd",
    )(vis, q, k, v, q_seg, kv_seg, q_slots, kv_slots)
    return out, (q, k, v, q_seg, kv_seg, q_slots, kv_slots, vis, out, lse)


def _fwd_rule(q, k, v, q_seg, kv_seg, q_slots, kv_slots, scale, block_sizes, interpret):
    return _forward(q, k, v, q_seg, kv_seg, q_slots, kv_slots, scale, block_sizes, interpret)


def _bwd_rule(scale, block_sizes, interpret, res, do):
    q, k, v, q_seg, kv_seg, q_slots, kv_slots, vis, out, lse = res
    b, n, t, h = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    bq, bk = block_sizes.block_q, block_sizes.block_k
    delta = jnp.einsum("BNTH,BNTH->BNT", out.astype(jnp.float32), do.astype(jnp.float32))
    args = (q, k, v, q_seg, kv_seg, q_slots, kv_slots, do, lse, delta)
    q_specs = _specs(n, kv_heads, t, s, h, bq, bk, grid_over="q")
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_k=bk),
        grid=(b, n, t // bq),
        in_specs=list(q_specs),
        out_specs=q_specs[1],
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_TRITON,
        interpret=interpret,
        name="doc_attention_dq",
    )(vis, *args)
    k_specs = _specs(n, kv_heads, t, s, h, bq, bk, grid_over="k")
    # Per query head [B, N, S, H]; a kv head's gradient is the sum over its G query heads.
    head_spec = pl.BlockSpec((None, None, bk, h), lambda b_, h_, j: (b_, h_, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, block_q=bq),
        grid=(b, n, s // bk),
        in_specs=list(k_specs),
        out_specs=[head_spec, head_spec],
        out_shape=[jax.ShapeDtypeStruct((b, n, s, h), jnp.float32)] * 2,
        compiler_params=_TRITON,
        interpret=interpret,
        name="doc_attention_dkv",
    )(vis.transpose(0, 2, 1), *args)
    g = n // kv_heads
    dk = dk.reshape(b, kv_heads, g, s, h).sum(2).astype(k.dtype)
    dv = dv.reshape(b, kv_heads, g, s, h).sum(2).astype(v.dtype)
    return dq, dk, dv, None, None, None, None


_doc_attention.defvjp(_fwd_rule, _bwd_rule)


def doc_attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_slots, kv_slots,
                  block_sizes: BlockSizes | None = None, scale: float | None = None,
                  interpret: bool = False):
    """q [B,T,N,H], k/v [B,K,S,H] (the model's cache layout) -> [B,T,N,H].

    The contract of `pallas_kernels.attention.dense_attention` plus kernel options. T and S need not be
    multiples of the block sizes (padded with segment 0); H should be a power of two on GPU.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[1]
    if n % kv_heads:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({kv_heads})")
    block_sizes = block_sizes or BlockSizes()
    scale = h**-0.5 if scale is None else scale
    bq, bk = block_sizes.block_q, block_sizes.block_k
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    q_ = _pad(q.transpose(0, 2, 1, 3), 2, bq)
    k_, v_ = _pad(k, 2, bk), _pad(v, 2, bk)
    out = _doc_attention(q_, k_, v_, _pad(i32(q_segment_ids), 1, bq),
                         _pad(i32(kv_segment_ids), 1, bk), _pad(i32(q_slots), 1, bq),
                         _pad(i32(kv_slots), 1, bk), scale, block_sizes, interpret)
    return out[:, :, :t].transpose(0, 2, 1, 3)
