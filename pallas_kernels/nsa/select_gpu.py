"""Selected-block attention (NSA's selected branch), GPU-style Pallas kernels (Triton lowering).

GQA-group-centric, as in the paper: one program per (batch, kv head, query position) loads the
G query heads of that kv group together and loops over the position's selected key blocks with
an online softmax. Backward: a dQ kernel with the same loop, and dK/dV from the inverted (CSR)
index -- for each key block, the queries that selected it. Those lists are cut into segments of
at most ``BlockSizes.dkdv_queries`` (block 0 is in every list, so one program per block would
serialise T queries); each segment program writes its own partial dK/dV tile and a second kernel
adds a block's partials in order: deterministic, no atomics.

Triton wants power-of-two tiles and at least 16 rows per dot: the wrapper zero-pads the group
to Gp >= 16 heads and the head dims to powers of two (exact: zero rows/columns change nothing).

Letters: B batch, T query time, S key time, N query heads, K kv heads, G heads per kv head,
H key head dim, V value head dim, J selected-block slots, P key blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.nsa import select_mgpu
from pallas_kernels.nsa._index import (
    Geometry,
    clean_block_idx,
    invert_block_idx,
    online_softmax,
    pad_axis,
    split_csr,
    visible_keys,
)

MIN_DOT_ROWS = 16  # Triton's smallest dot tile


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    num_warps: int = 4
    num_stages: int = 2
    dkdv_queries: int = 128  # most queries one dK/dV program walks (longer lists are split)
    # "mosaic": select_mgpu's Hopper kernels (TMA + wgmma) where they take the inputs (bf16/f16,
    # head dims of 128 bytes, blocks of 64), else this file's. Opt-in until a lent H100 has
    # compiled and timed them.
    backend: str = "triton"
    mosaic: select_mgpu.BlockSizes = select_mgpu.BlockSizes()


def _pow2(n, lo=1):
    return max(lo, pl.next_power_of_2(n))


def _fwd_kernel(q_ref, k_ref, v_ref, idx_ref, o_ref, lse_ref, *, block_size, s_len, causal, scale):
    t = pl.program_id(2)
    q = (q_ref[...].astype(jnp.float32) * scale).astype(k_ref.dtype)  # [Gp,H]; dots in the input dtype
    gp = q.shape[0]

    def body(i, carry):
        m, l, acc = carry
        blk = idx_ref[i]
        start = jnp.maximum(blk, 0) * block_size
        k = k_ref[pl.ds(start, block_size), :]  # [bs,H]
        v = v_ref[pl.ds(start, block_size), :]  # [bs,V]
        ok = visible_keys(blk, start, t, s_len, block_size, causal)[None, :]
        s = jnp.where(ok, plgpu.dot(q, k.T), -jnp.inf)  # [Gp,bs] float32
        return online_softmax(m, l, acc, s, ok, lambda p: plgpu.dot(p.astype(v.dtype), v))

    init = (
        jnp.full((gp,), -jnp.inf, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
        jnp.zeros((gp, v_ref.shape[-1]), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, idx_ref.shape[0], body, init)
    seen = l > 0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    # A row that saw no key gets lse = +inf, so the backward's exp(s - lse) is 0 there.
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)


def _probs(q, k, lse, ok):
    return jnp.where(ok, jnp.exp(plgpu.dot(q, k.T) - lse[:, None]), 0.0)


def _dq_kernel(q_ref, k_ref, v_ref, idx_ref, do_ref, lse_ref, delta_ref, dq_ref, *, block_size, s_len, causal, scale):
    t = pl.program_id(2)
    q = q_ref[...].astype(jnp.float32) * scale
    do = do_ref[...].astype(jnp.float32)
    lse, delta = lse_ref[...], delta_ref[...]

    def body(i, dq):
        blk = idx_ref[i]
        start = jnp.maximum(blk, 0) * block_size
        k = k_ref[pl.ds(start, block_size), :].astype(jnp.float32)
        v = v_ref[pl.ds(start, block_size), :].astype(jnp.float32)
        ok = visible_keys(blk, start, t, s_len, block_size, causal)[None, :]
        p = _probs(q, k, lse, ok)
        ds = p * (plgpu.dot(do, v.T) - delta[:, None])
        return dq + plgpu.dot(ds, k)

    dq = jax.lax.fori_loop(0, idx_ref.shape[0], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkdv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, query_ref, block_ref, lo_ref, hi_ref, dk_ref, dv_ref,
    *, block_size, s_len, causal, scale,
):
    """One segment of one key block's query list -> that segment's partial dK, dV."""
    z = pl.program_id(2)
    c = block_ref[z]
    first = c * block_size
    k = k_ref[pl.ds(first, block_size), :].astype(jnp.float32)  # [bs,H]
    v = v_ref[pl.ds(first, block_size), :].astype(jnp.float32)  # [bs,V]

    def body(i, carry):
        dk, dv = carry
        t = query_ref[i]
        q = q_ref[t, :, :].astype(jnp.float32) * scale  # [Gp,H]
        do = do_ref[t, :, :].astype(jnp.float32)  # [Gp,V]
        ok = visible_keys(c, first, t, s_len, block_size, causal)[None, :]
        p = _probs(q, k, lse_ref[t, :], ok)  # [Gp,bs]
        ds = p * (plgpu.dot(do, v.T) - delta_ref[t, :][:, None])
        return dk + plgpu.dot(ds.T, q), dv + plgpu.dot(p.T, do)

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(lo_ref[z], hi_ref[z], body, init)
    dk_ref[...] = dk  # q was pre-scaled, so dk already carries the scale
    dv_ref[...] = dv


def _sum_segments_kernel(dk_part_ref, dv_part_ref, first_ref, count_ref, dk_ref, dv_ref, *, block_size):
    """dK, dV of key block p: its segments' partial sums, added in order (deterministic)."""
    p = pl.program_id(2)

    def body(z, carry):
        dk, dv = carry
        rows = pl.ds(z * block_size, block_size)
        return dk + dk_part_ref[rows, :], dv + dv_part_ref[rows, :]

    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(first_ref[p], first_ref[p] + count_ref[p], body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _to_kernel_layout(q, k, v, block_idx, g: Geometry):
    """q[B,T,N,H] -> [B,T,K,Gp,Hp]; k,v -> [B,P*bs,K,Hp|Vp]; block_idx -> clean [B,T,K,Jp]."""
    b, t, _n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, g.groups, h)
    qg = pad_axis(pad_axis(qg, 3, _pow2(g.groups, MIN_DOT_ROWS)), 4, _pow2(h))
    k = pad_axis(pad_axis(k, 1, g.block_size), 3, _pow2(h))
    v = pad_axis(pad_axis(v, 1, g.block_size), 3, _pow2(v.shape[-1]))
    idx = clean_block_idx(block_idx, block_size=g.block_size, s_len=g.s_len, causal=g.causal)
    idx = pad_axis(idx, 3, _pow2(idx.shape[-1]), value=-1)
    return qg, k, v, idx


def _forward(qg, k, v, idx, g: Geometry, interpret):
    b, t, kh, gp, hp = qg.shape
    vp = v.shape[-1]
    sp = k.shape[1]
    jp = idx.shape[-1]
    kernel = functools.partial(
        _fwd_kernel, block_size=g.block_size, s_len=g.s_len, causal=g.causal, scale=g.scale
    )
    return pl.pallas_call(
        kernel,
        grid=(b, kh, t),
        in_specs=[
            pl.BlockSpec((None, None, None, gp, hp), lambda i, j, r: (i, r, j, 0, 0)),
            pl.BlockSpec((None, sp, None, hp), lambda i, j, r: (i, 0, j, 0)),
            pl.BlockSpec((None, sp, None, vp), lambda i, j, r: (i, 0, j, 0)),
            pl.BlockSpec((None, None, None, jp), lambda i, j, r: (i, r, j, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, gp, vp), lambda i, j, r: (i, r, j, 0, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, r: (i, j, r, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, t, kh, gp, vp), qg.dtype),
            jax.ShapeDtypeStruct((b, kh, t, gp), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(
            num_warps=g.block_sizes.num_warps, num_stages=g.block_sizes.num_stages
        ),
        interpret=interpret,
        name="nsa_select_fwd",
    )(qg, k, v, idx)


def _backward(qg, k, v, idx, o, lse, do, g: Geometry, interpret):
    b, t, kh, gp, hp = qg.shape
    vp = v.shape[-1]
    sp = k.shape[1]
    jp = idx.shape[-1]
    statics = {"block_size": g.block_size, "s_len": g.s_len, "causal": g.causal, "scale": g.scale}
    params = plgpu.CompilerParams(num_warps=g.block_sizes.num_warps, num_stages=g.block_sizes.num_stages)
    delta = jnp.einsum("btkgv,btkgv->bktg", o.astype(jnp.float32), do.astype(jnp.float32))
    row = lambda i, j, r: (i, r, j, 0, 0)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **statics),
        grid=(b, kh, t),
        in_specs=[
            pl.BlockSpec((None, None, None, gp, hp), row),
            pl.BlockSpec((None, sp, None, hp), lambda i, j, r: (i, 0, j, 0)),
            pl.BlockSpec((None, sp, None, vp), lambda i, j, r: (i, 0, j, 0)),
            pl.BlockSpec((None, None, None, jp), lambda i, j, r: (i, r, j, 0)),
            pl.BlockSpec((None, None, None, gp, vp), row),
            pl.BlockSpec((None, None, None, gp), lambda i, j, r: (i, j, r, 0)),
            pl.BlockSpec((None, None, None, gp), lambda i, j, r: (i, j, r, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, None, gp, hp), row),
        out_shape=jax.ShapeDtypeStruct(qg.shape, qg.dtype),
        compiler_params=params,
        interpret=interpret,
        name="nsa_select_dq",
    )(qg, k, v, idx, do, lse, delta)

    entry, start, end = invert_block_idx(idx, g.num_blocks)
    query = entry // jp
    seg_len = g.block_sizes.dkdv_queries
    n_seg = -(-t * jp // seg_len) + g.num_blocks  # every block may end in a partial segment
    seg_block, seg_lo, seg_hi, seg_first, seg_count = split_csr(start, end, seg_len, n_seg)
    bs = g.block_size
    whole = lambda i, j, z: (i, 0, j, 0, 0)
    per_head = lambda i, j, z: (i, j, 0)
    dk_part, dv_part = pl.pallas_call(
        functools.partial(_dkdv_kernel, **statics),
        grid=(b, kh, n_seg),
        in_specs=[
            pl.BlockSpec((None, t, None, gp, hp), whole),
            pl.BlockSpec((None, sp, None, hp), lambda i, j, z: (i, 0, j, 0)),
            pl.BlockSpec((None, sp, None, vp), lambda i, j, z: (i, 0, j, 0)),
            pl.BlockSpec((None, t, None, gp, vp), whole),
            pl.BlockSpec((None, None, t, gp), lambda i, j, z: (i, j, 0, 0)),
            pl.BlockSpec((None, None, t, gp), lambda i, j, z: (i, j, 0, 0)),
            pl.BlockSpec((None, None, t * jp), per_head),
            *[pl.BlockSpec((None, None, n_seg), per_head)] * 3,
        ],
        out_specs=[
            pl.BlockSpec((None, bs, None, hp), lambda i, j, z: (i, z, j, 0)),
            pl.BlockSpec((None, bs, None, vp), lambda i, j, z: (i, z, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, n_seg * bs, kh, hp), jnp.float32),
            jax.ShapeDtypeStruct((b, n_seg * bs, kh, vp), jnp.float32),
        ],
        compiler_params=params,
        interpret=interpret,
        name="nsa_select_dkdv",
    )(qg, k, v, do, lse, delta, query, seg_block, seg_lo, seg_hi)
    dk, dv = pl.pallas_call(
        functools.partial(_sum_segments_kernel, block_size=bs),
        grid=(b, kh, g.num_blocks),
        in_specs=[
            pl.BlockSpec((None, n_seg * bs, None, hp), lambda i, j, c: (i, 0, j, 0)),
            pl.BlockSpec((None, n_seg * bs, None, vp), lambda i, j, c: (i, 0, j, 0)),
            *[pl.BlockSpec((None, None, g.num_blocks), per_head)] * 2,
        ],
        out_specs=[
            pl.BlockSpec((None, bs, None, hp), lambda i, j, c: (i, c, j, 0)),
            pl.BlockSpec((None, bs, None, vp), lambda i, j, c: (i, c, j, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=params,
        interpret=interpret,
        name="nsa_select_dkdv_sum",
    )(dk_part, dv_part, seg_first, seg_count)
    return dq, dk, dv


def select_attention_gpu(
    q, k, v, block_idx, *, block_size, causal=True, scale=None, interpret=False, block_sizes=BlockSizes()
):
    """GPU-style selected-block attention; same contract as select_attention_reference."""
    g = Geometry.of(q, k, block_size=block_size, causal=causal, scale=scale, block_sizes=block_sizes)
    return _select(q, k, v, block_idx, g, interpret)


def _unpad_q(x, q_shape, g: Geometry):
    b, t, n, _ = q_shape
    return x[:, :, :, : g.groups].reshape(b, t, n, -1)


def _pad_rows(x, q_shape, g: Geometry, gp, width):
    """[B,T,N,X] -> the kernels' [B,T,K,Gp,width] (zero rows and columns)."""
    b, t, n, _ = q_shape
    x = x.reshape(b, t, n // g.groups, g.groups, -1)
    return pad_axis(pad_axis(x, 3, gp), 4, width)


def _mosaic(q, k, v, g: Geometry, interpret):
    """The Mosaic GPU kernels' interpret argument when they take these inputs, else None."""
    if g.block_sizes.backend != "mosaic" or select_mgpu.supports(q, k, v, g.block_size, g.block_sizes.mosaic):
        return None
    return select_mgpu.interpret_params(bool(interpret))


def _forward_any(q, k, v, block_idx, g: Geometry, interpret):
    """-> (out [B,T,N,V], lse [B,K,T,G]) from the kernels BlockSizes.backend picks."""
    if (mosaic := _mosaic(q, k, v, g, interpret)) is not None:
        return select_mgpu.select_forward_mgpu(q, k, v, block_idx, g, mosaic, g.block_sizes.mosaic)
    qg, kp, vp, idx = _to_kernel_layout(q, k, v, block_idx, g)
    o, lse = _forward(qg, kp, vp, idx, g, interpret)
    return _unpad_q(o, q.shape, g)[..., : v.shape[-1]], lse[..., : g.groups]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _select(q, k, v, block_idx, g: Geometry, interpret):
    return _forward_any(q, k, v, block_idx, g, interpret)[0]


def _select_fwd(q, k, v, block_idx, g, interpret):
    out, lse = _forward_any(q, k, v, block_idx, g, interpret)
    return out, (q, k, v, block_idx, out, lse)


def _select_bwd(g, interpret, res, dout):
    q, k, v, block_idx, out, lse = res
    if (mosaic := _mosaic(q, k, v, g, interpret)) is not None:
        grads = select_mgpu.select_backward_mgpu(q, k, v, block_idx, out, lse, dout, g, mosaic, g.block_sizes.mosaic)
        return (*grads, None)
    qg, kp, vp, idx = _to_kernel_layout(q, k, v, block_idx, g)
    gp, width = qg.shape[3], vp.shape[-1]
    o = _pad_rows(out, q.shape, g, gp, width)
    do = _pad_rows(dout, q.shape, g, gp, width)
    lse = pad_axis(lse, 3, gp, value=jnp.inf)  # padded rows see nothing
    dq, dk, dv = _backward(qg, kp, vp, idx, o, lse, do, g, interpret)
    dq = _unpad_q(dq, q.shape, g)[..., : q.shape[-1]]
    dk = dk[:, : k.shape[1], :, : k.shape[-1]]
    dv = dv[:, : v.shape[1], :, : v.shape[-1]]
    return dq, dk, dv, None


_select.defvjp(_select_fwd, _select_bwd)
