"""Sliding-window attention (NSA's window branch), TPU-style Pallas kernels (Mosaic TPU).

Flash attention over the band t - w < s <= t with the grid itself restricted to the band:
- forward and dQ: grid (batch, kv head, query tile, band step); the key-tile BlockSpec index
  map turns (query tile, step) into the step-th key tile meeting the query tile's band, so the
  pipeline DMAs only band tiles. The innermost "arbitrary" step axis runs the online softmax in
  VMEM scratch; steps past the band (tiles near the sequence ends meet fewer key tiles) repeat
  the last band tile, which is not re-fetched, and are skipped.
- dK/dV: grid (batch, kv head, key tile, band step) walking the query tiles that see the key
  tile, summing into scratch, one write per key tile: deterministic, no atomics.
A query tile is ``block_q`` positions with the G query heads of one kv group, flattened
query-major into rows (row = t * G + g), so one [rows, H] dot serves the whole group.

Letters: B batch, T query time, S key time, N query heads, K kv heads, G heads per kv head,
H key head dim, V value head dim, R rows of a query tile (positions x heads).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.nsa._index import online_softmax
from pallas_kernels.nsa.select_tpu import _interpret, flash_finish, flash_init
from pallas_kernels.nsa._band import Band, band_attention, to_keys, to_rows


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 128  # query positions per tile (a tile holds block_q * G rows)
    block_k: int = 128  # keys per key tile
    # Compiled, Mosaic wants block_k a multiple of 8 and block_q * G one of 128 (1-D lse rows).


def _key_tile(band: Band, r, j):
    """Step j of query tile r's band: its key tile, clipped into the band, and whether it is real."""
    lo, hi = band.key_tiles(r * band.tq)
    return jnp.clip(lo + j, 0, jnp.maximum(hi - 1, 0)), lo + j < hi


def _query_tile(band: Band, c, j):
    """Step j over the query tiles that see key tile c: the query tile (clipped) and whether it is real."""
    lo, hi = band.query_tiles(c * band.bk)
    return jnp.clip(lo + j, 0, jnp.maximum(hi - 1, 0)), lo + j < hi


def _mask(band: Band, q0, s0):
    """[R,bk] band mask of the query tile starting at q0 against the key tile starting at s0."""
    shape = (band.rows, band.bk)
    row = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    return band.visible(row, s0 + jax.lax.broadcasted_iota(jnp.int32, shape, 1), q0)


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *, band: Band):
    r, j, nj = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
    c, live = _key_tile(band, r, j)

    pl.when(j == 0)(lambda: flash_init(m_sc, l_sc, acc_sc))

    @pl.when(live)
    def _step():
        q = q_ref[...].astype(jnp.float32) * band.scale  # [R,H]
        ok = _mask(band, r * band.tq, c * band.bk)
        s = jnp.where(ok, jnp.dot(q, k_ref[...].astype(jnp.float32).T), -jnp.inf)  # [R,bk]
        m_sc[...], l_sc[...], acc_sc[...] = online_softmax(
            m_sc[...], l_sc[...], acc_sc[...], s, ok, lambda p: jnp.dot(p, v_ref[...].astype(jnp.float32)))

    # only a query past the last key (S < T) sees nothing
    pl.when(j == nj - 1)(lambda: flash_finish(m_sc, l_sc, acc_sc, o_ref, lse_ref))


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_sc, *, band: Band):
    r, j, nj = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
    c, live = _key_tile(band, r, j)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(live)
    def _step():
        q = q_ref[...].astype(jnp.float32) * band.scale
        k = k_ref[...].astype(jnp.float32)
        ok = _mask(band, r * band.tq, c * band.bk)
        p = jnp.where(ok, jnp.exp(jnp.dot(q, k.T) - lse_ref[...]), 0.0)
        dp = jnp.dot(do_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32).T)
        dq_sc[...] += jnp.dot(p * (dp - delta_ref[...]), k)

    @pl.when(j == nj - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * band.scale).astype(dq_ref.dtype)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_sc, dv_sc, *, band: Band):
    c, j, nj = pl.program_id(2), pl.program_id(3), pl.num_programs(3)
    r, live = _query_tile(band, c, j)

    @pl.when(j == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(live)
    def _step():
        q = q_ref[...].astype(jnp.float32) * band.scale  # [R,H]
        k = k_ref[...].astype(jnp.float32)  # [bk,H]
        do = do_ref[...].astype(jnp.float32)  # [R,V]
        ok = _mask(band, r * band.tq, c * band.bk)
        p = jnp.where(ok, jnp.exp(jnp.dot(q, k.T) - lse_ref[...]), 0.0)  # [R,bk]
        ds = p * (jnp.dot(do, v_ref[...].astype(jnp.float32).T) - delta_ref[...])
        dk_sc[...] += jnp.dot(ds.T, q)  # q was pre-scaled, so dk already carries the scale
        dv_sc[...] += jnp.dot(p.T, do)

    @pl.when(j == nj - 1)
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _tiles(size, d, index):
    """BlockSpec, on a grid (b, h, x, j), of the [size, d] tile index(x, j) (d None: a [size, 1]
    column of log-sum-exp or delta, kept [B,K,rows,1] for Mosaic)."""
    return pl.BlockSpec((None, None, size, d or 1), lambda b, h, x, j: (b, h, index(x, j), 0))


def _own(x, _j):
    return x


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


def _forward(qr, k, v, band: Band, interpret):
    """qr [B,K,Tp*G,H], k/v [B,K,Sp,H|V] -> o [B,K,Tp*G,V], lse [B,K,Tp*G,1]."""
    b, kh, tr, hd = qr.shape
    vd, rows = v.shape[-1], band.rows
    keys = lambda r, j: _key_tile(band, r, j)[0]
    return pl.pallas_call(
        functools.partial(_fwd_kernel, band=band),
        grid=(b, kh, band.num_q_tiles, band.band_k_tiles),
        in_specs=[_tiles(rows, hd, _own), _tiles(band.bk, hd, keys), _tiles(band.bk, vd, keys)],
        out_specs=[_tiles(rows, vd, _own), _tiles(rows, None, _own)],
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, tr, vd), qr.dtype),
            jax.ShapeDtypeStruct((b, kh, tr, 1), jnp.float32),
        ],
        scratch_shapes=[
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, vd), jnp.float32),
        ],
        compiler_params=_params(),
        interpret=_interpret(interpret),
        name="nsa_window_fwd_tpu",
    )(qr, k, v)


def _backward(qr, k, v, do, lse, delta, band: Band, interpret):
    b, kh, _, hd = qr.shape
    delta = delta[..., None]  # [B,K,Tp*G,1] like lse
    vd, rows, bk = v.shape[-1], band.rows, band.bk
    keys = lambda r, j: _key_tile(band, r, j)[0]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, band=band),
        grid=(b, kh, band.num_q_tiles, band.band_k_tiles),
        in_specs=[
            _tiles(rows, hd, _own),
            _tiles(bk, hd, keys),
            _tiles(bk, vd, keys),
            _tiles(rows, vd, _own),
            *[_tiles(rows, None, _own)] * 2,
        ],
        out_specs=_tiles(rows, hd, _own),
        out_shape=jax.ShapeDtypeStruct(qr.shape, qr.dtype),
        scratch_shapes=[pltpu.VMEM((rows, hd), jnp.float32)],
        compiler_params=_params(),
        interpret=_interpret(interpret),
        name="nsa_window_dq_tpu",
    )(qr, k, v, do, lse, delta)
    queries = lambda c, j: _query_tile(band, c, j)[0]
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, band=band),
        grid=(b, kh, band.num_k_tiles, band.band_q_tiles),
        in_specs=[
            _tiles(rows, hd, queries),
            _tiles(bk, hd, _own),
            _tiles(bk, vd, _own),
            _tiles(rows, vd, queries),
            *[_tiles(rows, None, queries)] * 2,
        ],
        out_specs=[_tiles(bk, hd, _own), _tiles(bk, vd, _own)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((bk, hd), jnp.float32), pltpu.VMEM((bk, vd), jnp.float32)],
        compiler_params=_params(),
        interpret=_interpret(interpret),
        name="nsa_window_dkdv_tpu",
    )(qr, k, v, do, lse, delta)
    return dq, dk, dv


def _layout(q, k, v, band: Band):
    """q -> [B,K,Tp*G,H]; k, v -> [B,K,Sp,H|V] (no head padding: Mosaic takes whole head dims)."""
    return to_rows(q, k.shape[2], band, q.shape[-1]), to_keys(k, band, k.shape[-1]), to_keys(v, band, v.shape[-1])


_window = band_attention(_layout, _forward, _backward)


def sliding_window_attention_tpu(q, k, v, *, window, scale=None, interpret=False, block_sizes=BlockSizes()):
    """TPU-style sliding-window attention; same contract as sliding_window_reference."""
    band = Band.of(
        q, k, window=window, scale=scale, groups=q.shape[2] // k.shape[2],
        tq=block_sizes.block_q, bk=block_sizes.block_k, block_sizes=block_sizes,
    )
    return _window(q, k, v, band, interpret)
