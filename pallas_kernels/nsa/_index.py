"""Plumbing shared by the NSA kernels: index work in plain JAX outside the kernels, and the
online-softmax step they all run inside.

Letters: B batch, T query time, S key time, K kv heads, J selected-block slots, P key blocks.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static shapes and the padded layouts the kernels see."""

    t_len: int
    s_len: int
    groups: int
    block_size: int
    causal: bool
    scale: float
    block_sizes: object  # the kernel file's BlockSizes

    @property
    def num_blocks(self):
        return -(-self.s_len // self.block_size)

    @classmethod
    def of(cls, q, k, *, block_size, causal, scale, block_sizes):
        return cls(
            t_len=q.shape[1],
            s_len=k.shape[1],
            groups=q.shape[2] // k.shape[2],
            block_size=block_size,
            causal=causal,
            scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale),
            block_sizes=block_sizes,
        )


def clean_block_idx(block_idx, *, block_size, s_len, causal):
    """Canonical block lists [B,T,K,J]: out-of-range, repeated and (causal) wholly future
    blocks become -1, so the kernels may loop over slots without de-duplicating."""
    num_blocks = -(-s_len // block_size)
    idx = jnp.where((block_idx >= 0) & (block_idx < num_blocks), block_idx, -1)
    if causal:
        t = jnp.arange(block_idx.shape[1])[None, :, None, None]
        idx = jnp.where(idx * block_size <= t, idx, -1)
    idx = jnp.sort(idx, axis=-1)
    repeat = jnp.concatenate([jnp.zeros_like(idx[..., :1], bool), idx[..., 1:] == idx[..., :-1]], -1)
    return jnp.where(repeat, -1, idx).astype(jnp.int32)


def invert_block_idx(block_idx, num_blocks):
    """The inverted (CSR) index: for each key block, the entries that list it.

    block_idx [B,T,K,J] (clean) -> entry [B,K,T*J] (flat indices t*J + j grouped by block,
    ascending within a block; entry // J is the query), start [B,K,P], end [B,K,P]: block p is
    listed by entry[start:end].
    """
    b, t, k, j = block_idx.shape
    flat = jnp.transpose(block_idx, (0, 2, 1, 3)).reshape(b, k, t * j)
    key = jnp.where(flat >= 0, flat, num_blocks)  # unused slots sort last

    def one(key_bk):
        order = jnp.argsort(key_bk, stable=True)
        sorted_key = key_bk[order]
        blocks = jnp.arange(num_blocks)
        start = jnp.searchsorted(sorted_key, blocks, side="left")
        end = jnp.searchsorted(sorted_key, blocks, side="right")
        return order.astype(jnp.int32), start.astype(jnp.int32), end.astype(jnp.int32)

    return jax.vmap(jax.vmap(one))(key)


def split_csr(start, end, seg_len, num_segments):
    """Cut each block's query list into segments of at most seg_len, so no program walks a long
    list alone (block 0 is in every query's list). start, end [B,K,P] -> per segment [B,K,Z]:
    its block, first and last+1 list position (empty past the real ones), and per block [B,K,P]
    its first segment and segment count. num_segments (static) must bound the total."""
    count = end - start
    nseg = -(-count // seg_len)
    upto = jnp.cumsum(nseg, axis=-1)
    first = upto - nseg
    seg = jnp.arange(num_segments)

    def one(start, end, first, upto):
        block = jnp.minimum(jnp.searchsorted(upto, seg, side="right"), start.shape[0] - 1)
        lo = start[block] + (seg - first[block]) * seg_len
        real = seg < upto[-1]
        lo = jnp.where(real, lo, 0)
        hi = jnp.where(real, jnp.minimum(lo + seg_len, end[block]), 0)
        return block.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32)

    block, lo, hi = jax.vmap(jax.vmap(one))(start, end, first, upto)
    return block, lo, hi, first.astype(jnp.int32), nseg.astype(jnp.int32)


def visible_keys(blk, start, t, s_len, block_size, causal):
    """[bs] mask of the keys of block blk (first key at start) that query t may see."""
    pos = start + jnp.arange(block_size)
    ok = (pos < s_len) & (blk >= 0)
    return (ok & (pos <= t)) if causal else ok


def pad_axis(x, axis, multiple, value=0):
    """Pad x along axis up to a multiple."""
    size = x.shape[axis]
    extra = -size % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def online_softmax(m, l, acc, s, ok, pv):
    """One step of the streaming softmax over a tile of scores s[R,bk] (ok masks them): running
    max m and sum l ([R], or [R,1] as TPU scratch keeps them) and output acc[R,V]; pv(p) is the
    kernel's p @ V. -> (m, l, acc). A row that has seen nothing keeps m = -inf and l = 0."""
    keep = m.ndim == 2
    col = (lambda x: x) if keep else (lambda x: x[:, None])
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=keep))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.where(ok, jnp.exp(s - col(m_safe)), 0.0)
    alpha = jnp.exp(m - m_safe)
    return m_new, alpha * l + jnp.sum(p, axis=1, keepdims=keep), col(alpha) * acc + pv(p)
