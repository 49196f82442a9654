"""Sliding-window attention (NSA's window branch), GPU-style Pallas kernels (Triton lowering).

Flash attention restricted to the band t - w < s <= t. GQA-group-centric like the selected
kernels: a query tile is ``tq`` consecutive positions with the (padded) Gp query heads of one
kv group, flattened query-major into rows (row = t * Gp + g), so one [R, H] dot serves the group.
- forward and dQ: one program per (batch, kv head, query tile) loops over only the key tiles
  that meet the tile's band [t0 - w + 1, t0 + tq - 1] with an online softmax: O(T * w) work.
- dK/dV: one program per (batch, kv head, key tile) loops over the query tiles that can see it,
  [s0, s0 + bk + w - 2], and writes its own tile: deterministic, no atomics.

Triton wants power-of-two tiles and at least 16 rows per dot: the wrapper zero-pads the group to
Gp (a power of two) and the head dims to powers of two >= 16 (exact: zero rows/columns change
nothing; a padded head has zero dO, so it adds nothing to dK/dV).

Letters: B batch, T query time, S key time, N query heads, K kv heads, G heads per kv head,
H key head dim, V value head dim, R rows of a query tile (positions x heads).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.nsa import select_mgpu
from pallas_kernels.nsa._band import Band, band_attention, to_keys, to_rows
from pallas_kernels.nsa._index import online_softmax
from pallas_kernels.nsa.select_gpu import MIN_DOT_ROWS, _pow2, _probs


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 64  # rows per query tile: max(block_q, Gp) // Gp positions of Gp heads each
    block_k: int = 64  # keys per key tile; both powers of two, >= 16 compiled (Triton's dots)
    num_warps: int = 4
    num_stages: int = 2
    # "mosaic": select_mgpu's Hopper kernels (each tile's band as its block selection) where they
    # take the inputs, else these. Opt-in until a lent H100 has compiled and timed them.
    backend: str = "triton"
    mosaic: select_mgpu.BlockSizes = select_mgpu.BlockSizes()


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, band: Band):
    q0 = pl.program_id(2) * band.tq
    q = (q_ref[...].astype(jnp.float32) * band.scale).astype(k_ref.dtype)  # [R,H]; dots in the input dtype
    row = jnp.arange(band.rows)[:, None]

    def body(c, carry):
        m, l, acc = carry
        start = c * band.bk
        k = k_ref[pl.ds(start, band.bk), :]  # [bk,H]
        v = v_ref[pl.ds(start, band.bk), :]  # [bk,V]
        ok = band.visible(row, start + jnp.arange(band.bk)[None, :], q0)
        s = jnp.where(ok, plgpu.dot(q, k.T), -jnp.inf)  # [R,bk] float32
        return online_softmax(m, l, acc, s, ok, lambda p: plgpu.dot(p.astype(v.dtype), v))

    init = (
        jnp.full((band.rows,), -jnp.inf, jnp.float32),
        jnp.zeros((band.rows,), jnp.float32),
        jnp.zeros((band.rows, v_ref.shape[-1]), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(*band.key_tiles(q0), body, init)
    # Every real query sees itself; only a query past the last key (S < T) sees nothing: o = 0,
    # lse = +inf, so the backward's exp(s - lse) is 0 there.
    seen = l > 0
    o_ref[...] = (acc / jnp.where(seen, l, 1.0)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, band: Band):
    q0 = pl.program_id(2) * band.tq
    q = q_ref[...].astype(jnp.float32) * band.scale
    do = do_ref[...].astype(jnp.float32)
    lse, delta = lse_ref[...], delta_ref[...]
    row = jnp.arange(band.rows)[:, None]

    def body(c, dq):
        start = c * band.bk
        k = k_ref[pl.ds(start, band.bk), :].astype(jnp.float32)
        v = v_ref[pl.ds(start, band.bk), :].astype(jnp.float32)
        p = _probs(q, k, lse, band.visible(row, start + jnp.arange(band.bk)[None, :], q0))
        ds = p * (plgpu.dot(do, v.T) - delta[:, None])
        return dq + plgpu.dot(ds, k)

    dq = jax.lax.fori_loop(*band.key_tiles(q0), body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * band.scale).astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, band: Band):
    """One key tile: its dK, dV summed over the query tiles that see it, in order."""
    s0 = pl.program_id(2) * band.bk
    k = k_ref[...].astype(jnp.float32)  # [bk,H]
    v = v_ref[...].astype(jnp.float32)  # [bk,V]
    row = jnp.arange(band.rows)[:, None]
    key = s0 + jnp.arange(band.bk)[None, :]

    def body(i, carry):
        dk, dv = carry
        rows = pl.ds(i * band.rows, band.rows)
        q = q_ref[rows, :].astype(jnp.float32) * band.scale  # [R,H]
        do = do_ref[rows, :].astype(jnp.float32)  # [R,V]
        p = _probs(q, k, lse_ref[rows], band.visible(row, key, i * band.tq))  # [R,bk]
        ds = p * (plgpu.dot(do, v.T) - delta_ref[rows][:, None])
        return dk + plgpu.dot(ds.T, q), dv + plgpu.dot(p.T, do)

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(*band.query_tiles(s0), body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)  # q was pre-scaled, so dk already carries the scale
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _params(band: Band):
    return plgpu.CompilerParams(num_warps=band.block_sizes.num_warps, num_stages=band.block_sizes.num_stages)


def _forward(qr, k, v, band: Band, interpret):
    """qr [B,K,Tp*Gp,H], k/v [B,K,Sp,H|V] -> o [B,K,Tp*Gp,V], lse [B,K,Tp*Gp]."""
    b, kh, tr, hp = qr.shape
    sp, vp = k.shape[2], v.shape[-1]
    tile = lambda i, j, r: (i, j, r, 0)
    whole = lambda i, j, r: (i, j, 0, 0)
    return pl.pallas_call(
        functools.partial(_fwd_kernel, band=band),
        grid=(b, kh, band.num_q_tiles),
        in_specs=[
            pl.BlockSpec((None, None, band.rows, hp), tile),
            pl.BlockSpec((None, None, sp, hp), whole),
            pl.BlockSpec((None, None, sp, vp), whole),
        ],
        out_specs=[
            pl.BlockSpec((None, None, band.rows, vp), tile),
            pl.BlockSpec((None, None, band.rows), lambda i, j, r: (i, j, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, tr, vp), qr.dtype),
            jax.ShapeDtypeStruct((b, kh, tr), jnp.float32),
        ],
        compiler_params=_params(band),
        interpret=interpret,
        name="nsa_window_fwd",
    )(qr, k, v)


def _backward(qr, k, v, do, lse, delta, band: Band, interpret):
    b, kh, tr, hp = qr.shape
    sp, vp = k.shape[2], v.shape[-1]
    tile = lambda i, j, r: (i, j, r, 0)
    whole = lambda i, j, r: (i, j, 0, 0)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, band=band),
        grid=(b, kh, band.num_q_tiles),
        in_specs=[
            pl.BlockSpec((None, None, band.rows, hp), tile),
            pl.BlockSpec((None, None, sp, hp), whole),
            pl.BlockSpec((None, None, sp, vp), whole),
            pl.BlockSpec((None, None, band.rows, vp), tile),
            *[pl.BlockSpec((None, None, band.rows), lambda i, j, r: (i, j, r))] * 2,
        ],
        out_specs=pl.BlockSpec((None, None, band.rows, hp), tile),
        out_shape=jax.ShapeDtypeStruct(qr.shape, qr.dtype),
        compiler_params=_params(band),
        interpret=interpret,
        name="nsa_window_dq",
    )(qr, k, v, do, lse, delta)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, band=band),
        grid=(b, kh, band.num_k_tiles),
        in_specs=[
            pl.BlockSpec((None, None, tr, hp), whole),
            pl.BlockSpec((None, None, band.bk, hp), tile),
            pl.BlockSpec((None, None, band.bk, vp), tile),
            pl.BlockSpec((None, None, tr, vp), whole),
            *[pl.BlockSpec((None, None, tr), lambda i, j, c: (i, j, 0))] * 2,
        ],
        out_specs=[pl.BlockSpec((None, None, band.bk, hp), tile), pl.BlockSpec((None, None, band.bk, vp), tile)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(band),
        interpret=interpret,
        name="nsa_window_dkdv",
    )(qr, k, v, do, lse, delta)
    return dq, dk, dv


def _layout(q, k, v, band: Band):
    """q -> [B,K,Tp*Gp,Hp]; k, v -> [B,K,Sp,Hp|Vp] (head dims padded to powers of two >= 16)."""
    kh = k.shape[2]
    hp, vp = _pow2(q.shape[-1], MIN_DOT_ROWS), _pow2(v.shape[-1], MIN_DOT_ROWS)
    return to_rows(q, kh, band, hp), to_keys(k, band, hp), to_keys(v, band, vp)


_window = band_attention(_layout, _forward, _backward)


def sliding_window_attention_gpu(q, k, v, *, window, scale=None, interpret=False, block_sizes=BlockSizes()):
    """GPU-style sliding-window attention; same contract as sliding_window_reference."""
    if block_sizes.backend == "mosaic" and select_mgpu.supports(q, k, v, select_mgpu.ROWS, block_sizes.mosaic) is None:
        return select_mgpu.sliding_window_attention_mgpu(
            q, k, v, window=window, scale=scale, interpret=interpret, block_sizes=block_sizes.mosaic
        )
    gp = _pow2(q.shape[2] // k.shape[2])
    rows = max(block_sizes.block_q, gp)
    band = Band.of(
        q, k, window=window, scale=scale, groups=gp, tq=rows // gp, bk=block_sizes.block_k, block_sizes=block_sizes
    )
    return _window(q, k, v, band, interpret)
