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
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.nsa._index import online_softmax, pad_axis
from pallas_kernels.nsa.select_gpu import MIN_DOT_ROWS, _pow2, _probs


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 64  # rows per query tile: max(block_q, Gp) // Gp positions of Gp heads each
    block_k: int = 64  # keys per key tile; both powers of two, >= 16 compiled (Triton's dots)
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class Band:
    """Static band geometry shared by the GPU- and TPU-style kernels: query tiles of ``tq``
    positions x ``groups`` rows each (query-major), key tiles of ``bk`` keys."""

    t_len: int
    s_len: int
    window: int
    scale: float
    groups: int  # rows per query position (G, or G padded)
    tq: int
    bk: int
    block_sizes: object  # the kernel file's BlockSizes

    @classmethod
    def of(cls, q, k, *, window, scale, groups, tq, bk, block_sizes):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return cls(q.shape[1], k.shape[1], int(window), scale, groups, tq, bk, block_sizes)

    @property
    def rows(self):
        return self.tq * self.groups

    @property
    def num_q_tiles(self):
        return -(-self.t_len // self.tq)

    @property
    def num_k_tiles(self):
        return -(-self.s_len // self.bk)

    @property
    def band_k_tiles(self):
        """Most key tiles one query tile's band meets (its keys span tq + w - 1 positions)."""
        return min(self.num_k_tiles, (self.bk + self.tq + self.window - 3) // self.bk + 1)

    @property
    def band_q_tiles(self):
        """Most query tiles that see one key tile (their queries span bk + w - 1 positions)."""
        return min(self.num_q_tiles, (self.tq + self.bk + self.window - 3) // self.tq + 1)

    def key_tiles(self, q0):
        """Key tiles [lo, hi) that the real queries (t < T) of the query tile starting at position
        q0 see (empty if none)."""
        lo = jax.lax.div(jnp.maximum(q0 - self.window + 1, 0), self.bk)
        hi = jax.lax.div(jnp.minimum(q0 + self.tq, min(self.t_len, self.s_len)) - 1, self.bk) + 1
        return lo, hi

    def query_tiles(self, s0):
        """Query tiles [lo, hi) that see some key of the key tile starting at position s0."""
        lo = jax.lax.div(s0, self.tq)
        hi = jax.lax.div(jnp.minimum(s0 + self.bk + self.window - 2, self.t_len - 1), self.tq) + 1
        return lo, hi

    def visible(self, row, key, q0):
        """Mask: row (of the tile at q0, position q0 + row // groups) sees key (absolute).
        floor(row / G) >= x iff row >= x * G, so no integer division is needed. Padding rows
        (t >= T, padded heads) are left visible: their dO is zero, so they add no gradient."""
        rel = key - q0
        return (row >= rel * self.groups) & (row < (rel + self.window) * self.groups) & (key < self.s_len)


def to_rows(x, kh, band: Band, d):
    """[B,T,N,*] -> [B,K,Tp*groups,d]: each kv group's query rows, query-major, zero-padded
    (T to whole tiles, the group to ``groups`` heads, the head dim to d)."""
    b, t, n, _ = x.shape
    x = x.reshape(b, t, kh, n // kh, -1)
    x = pad_axis(pad_axis(pad_axis(x, 1, band.tq), 3, band.groups), 4, d)
    return jnp.transpose(x, (0, 2, 1, 3, 4)).reshape(b, kh, -1, d)


def from_rows(x, band: Band, shape):
    """[B,K,Tp*groups,*] -> [B,T,N,D] = shape, dropping the padding."""
    b, t, n, d = shape
    kh = x.shape[1]
    x = x.reshape(b, kh, -1, band.groups, x.shape[-1])[:, :, :t, : n // kh, :d]
    return jnp.transpose(x, (0, 2, 1, 3, 4)).reshape(shape)


def to_keys(x, band: Band, d):
    """[B,S,K,*] -> [B,K,Sp,d], zero-padded."""
    return jnp.transpose(pad_axis(pad_axis(x, 1, band.bk), 3, d), (0, 2, 1, 3))


def from_keys(x, shape):
    """[B,K,Sp,*] -> [B,S,K,D] = shape, dropping the padding."""
    return jnp.transpose(x[:, :, : shape[1], : shape[3]], (0, 2, 1, 3))


def band_attention(layout, forward, backward):
    """The differentiable attention(q, k, v, band, interpret) over a kernel file's layout
    (q, k, v, band) -> (q rows, k, v), forward(...) -> (o rows, lse) and backward(...)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def attend(q, k, v, band, interpret):
        return attend_fwd(q, k, v, band, interpret)[0]

    def attend_fwd(q, k, v, band, interpret):
        o, lse = forward(*layout(q, k, v, band), band, interpret)
        return from_rows(o, band, (*q.shape[:3], v.shape[-1])), (q, k, v, o, lse)

    def attend_bwd(band, interpret, res, dout):
        q, k, v, o, lse = res
        qr, kt, vt = layout(q, k, v, band)
        do = to_rows(dout, k.shape[2], band, vt.shape[-1])
        delta = jnp.einsum("bkrv,bkrv->bkr", o.astype(jnp.float32), do.astype(jnp.float32))
        dq, dk, dv = backward(qr, kt, vt, do, lse, delta, band, interpret)
        return from_rows(dq, band, q.shape), from_keys(dk, k.shape), from_keys(dv, v.shape)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


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
    gp = _pow2(q.shape[2] // k.shape[2])
    rows = max(block_sizes.block_q, gp)
    band = Band.of(
        q, k, window=window, scale=scale, groups=gp, tq=rows // gp, bk=block_sizes.block_k, block_sizes=block_sizes
    )
    return _window(q, k, v, band, interpret)
