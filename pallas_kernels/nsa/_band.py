"""Banded attention geometry and the row layout shared by the window and compressed kernels.

Both NSA branches are flash attention where key i sits at position ``stride * i + first`` and
query t sees it iff t - window < pos(i) <= t:
- the sliding window: stride 1, first 0, window w;
- the compressed branch (eq. 7): key i summarises keys i*d .. i*d+l-1, so stride d, first l-1,
  and no window (every completed block is visible).

A query tile is ``tq`` consecutive positions with the ``groups`` query heads of one kv group,
flattened query-major into rows (row = t * groups + g), so one [R, H] dot serves the group.

Letters: B batch, T query time, S key time, N query heads, K kv heads, G heads per kv head,
H key head dim, V value head dim, R rows of a query tile (positions x heads).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.nsa._index import pad_axis


@dataclasses.dataclass(frozen=True)
class Band:
    """Static band geometry shared by the GPU- and TPU-style kernels: query tiles of ``tq``
    positions x ``groups`` rows each (query-major), key tiles of ``bk`` keys; key i at position
    stride * i + first; window None: no lower bound."""

    t_len: int
    s_len: int
    window: int | None
    scale: float
    groups: int  # rows per query position (G, or G padded)
    tq: int
    bk: int
    block_sizes: object  # the kernel file's BlockSizes
    stride: int = 1
    first: int = 0

    @classmethod
    def of(cls, q, k, *, window, scale, groups, tq, bk, block_sizes, stride=1, first=0):
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        window = None if window is None else int(window)
        return cls(q.shape[1], k.shape[1], window, scale, groups, tq, bk, block_sizes, stride, first)

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
        """Most key tiles one query tile meets: its positions span tq + w - 1, so at most
        (tq + w - 2) // stride + 1 keys."""
        if self.window is None:
            return self.num_k_tiles
        keys = (self.tq + self.window - 2) // self.stride + 1
        return min(self.num_k_tiles, (keys + self.bk - 2) // self.bk + 1)

    @property
    def band_q_tiles(self):
        """Most query tiles that see one key tile: its keys span stride * (bk - 1) + 1 positions,
        each seen by w queries."""
        if self.window is None:
            return self.num_q_tiles
        span = self.stride * (self.bk - 1) + self.window
        return min(self.num_q_tiles, (span + self.tq - 2) // self.tq + 1)

    def key_tiles(self, q0):
        """Key tiles [lo, hi) that the real queries (t < T) of the query tile starting at position
        q0 see (empty if none). Only non-negative integers are divided (lax.div truncates)."""
        if self.window is None:
            lo = jnp.zeros_like(q0)
        else:
            below = jnp.maximum(q0 - self.window + 1 - self.first, 0)  # lowest visible position - first
            lo = jax.lax.div(jax.lax.div(below + self.stride - 1, self.stride), self.bk)
        last = jnp.minimum(q0 + self.tq, self.t_len) - 1  # the tile's last real query
        seen = jax.lax.div(jnp.maximum(last - self.first + self.stride, 0), self.stride)  # keys 0..seen-1 <= last
        seen = jnp.minimum(seen, self.s_len)
        return lo, jax.lax.div(seen + self.bk - 1, self.bk)

    def query_tiles(self, s0):
        """Query tiles [lo, hi) that see some key of the key tile starting at key s0."""
        pos = self.stride * s0 + self.first
        lo = jax.lax.div(pos, self.tq)
        if self.window is None:
            return lo, jnp.full_like(lo, self.num_q_tiles)
        last = jnp.minimum(pos + self.stride * (self.bk - 1) + self.window - 1, self.t_len - 1)
        return lo, jax.lax.div(last, self.tq) + 1

    def visible(self, row, key, q0):
        """Mask: row (of the tile at q0, position q0 + row // groups) sees key (index).
        floor(row / G) >= x iff row >= x * G, so no integer division is needed. Padding rows
        (t >= T, padded heads) are left visible: their dO is zero, so they add no gradient."""
        rel = self.stride * key + self.first - q0
        ok = (row >= rel * self.groups) & (key < self.s_len)
        if self.window is not None:
            ok &= row < (rel + self.window) * self.groups
        return ok


def to_rows(x, kh, band: Band, d):
    """[B,T,N,*] -> [B,K,Tp*groups,d]: each kv group's query rows, query-major, zero-padded
    (T to whole tiles, the group to ``groups`` heads, the head dim to d). These helpers read only
    band.tq, band.groups and band.bk (select_mgpu's layout passes its own)."""
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


def to_keys(x, band: Band, d, multiple=None):
    """[B,S,K,*] -> [B,K,Sp,d], zero-padded to a multiple of the key tile (or of ``multiple``)."""
    return jnp.transpose(pad_axis(pad_axis(x, 1, multiple or band.bk), 3, d), (0, 2, 1, 3))


def from_keys(x, shape):
    """[B,K,Sp,*] -> [B,S,K,D] = shape, dropping the padding."""
    return jnp.transpose(x[:, :, : shape[1], : shape[3]], (0, 2, 1, 3))


def band_attention(layout, forward, backward, extra=None):
    """The differentiable attention(q, k, v, band, interpret) over a kernel file's layout
    (q, k, v, band) -> (q rows, k, v), forward(...) -> (o rows, lse) and backward(...).

    With ``extra(q rows, k, lse, band, interpret)`` the function returns (o, extra's output): a
    by-product of the softmax (the compressed branch's block scores) that takes no gradient.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def attend(q, k, v, band, interpret):
        return attend_fwd(q, k, v, band, interpret)[0]

    def attend_fwd(q, k, v, band, interpret):
        qr, kt, vt = layout(q, k, v, band)
        o, lse = forward(qr, kt, vt, band, interpret)
        out = from_rows(o, band, (*q.shape[:3], v.shape[-1]))
        if extra is not None:
            out = (out, extra(qr, kt, lse, band, interpret))
        return out, (q, k, v, o, lse)

    def attend_bwd(band, interpret, res, dout):
        q, k, v, o, lse = res
        if extra is not None:
            dout = dout[0]  # the by-product's cotangent is dropped
        qr, kt, vt = layout(q, k, v, band)
        do = to_rows(dout, k.shape[2], band, vt.shape[-1])
        delta = jnp.einsum("bkrv,bkrv->bkr", o.astype(jnp.float32), do.astype(jnp.float32))
        dq, dk, dv = backward(qr, kt, vt, do, lse, delta, band, interpret)
        return from_rows(dq, band, q.shape), from_keys(dk, k.shape), from_keys(dv, v.shape)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend
