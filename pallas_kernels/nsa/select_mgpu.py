"""Selected-block attention for Hopper, Pallas' Mosaic GPU backend (TMA + wgmma), forward and backward.

A wgmma takes 64 rows, and one position's GQA group has G <= 16 heads, so the paper's
one-position-per-program design would waste 4x the tensor core and reload the same key blocks
for every neighbouring position. Neighbouring queries pick mostly the same blocks (their local
blocks and top-scoring ones agree), so a program here owns a tile of R = 64 / Gp consecutive
positions x Gp heads and walks the *union* of their selected blocks once, each row masked to
the blocks its own position picked (a bit per position, precomputed with the union). A memory
warpgroup streams the union's key/value blocks through ``stages`` shared-memory slots with TMA
while the compute warpgroup runs the online softmax over them; dQ walks the same unions. dK/dV
invert them: for each key block, the tiles whose union holds it (CSR), cut into segments of at
most ``dkdv_tiles`` whose partial sums a last kernel adds in order (deterministic, no atomics).
Transposed products (S^T = K Q^T, dP^T = V dO^T) keep every wgmma at 64 rows. The window and
the compressed branch (compressed_mgpu) run on the same kernels: a band's tiles take the key
blocks they see as their selection, and ``_band.Band.visible`` as their mask.

Letters: B batch, T query time, K kv heads, G heads per kv head (Gp padded to a power of two),
H key head dim, V value head dim, J selected-block slots, R positions per tile, U union slots.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.nsa._band import Band, band_attention, from_keys, from_rows, to_keys, to_rows
from pallas_kernels.nsa._index import (
    Geometry,
    clean_block_idx,
    invert_block_idx,
    pad_axis,
    split_csr,
)

ROWS = 64  # one warpgroup's wgmma M
LANE_BYTES = 128  # swizzle width: the head dims must fill whole 128-byte rows


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    stages: int = 3  # key/value blocks (forward, dQ) or query tiles (dK/dV) in flight
    dkdv_tiles: int = 64  # most query tiles one dK/dV program walks (longer lists are split)


SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block


def smem_bytes(h, vd, block_size, stages, itemsize=2):
    """Shared memory of the hungriest of the four kernels (dK/dV, usually)."""
    bs, hv = block_size, h + vd
    forward = (ROWS * (h + vd + bs) + stages * bs * hv) * itemsize + ROWS * 4
    dq = (ROWS * (hv + bs) + stages * bs * hv) * itemsize + 2 * ROWS * 4
    dkdv = (bs * hv + stages * ROWS * hv + 2 * bs * ROWS) * itemsize + stages * 2 * ROWS * 4 + bs * hv * 4
    return max(forward, dq, dkdv, bs * hv * (4 + itemsize))


def supports(q, k, v, block_size, block_sizes=BlockSizes()) -> str | None:
    """Why these kernels cannot take these inputs, or None when they can."""
    groups = q.shape[2] // k.shape[2]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or not (q.dtype == k.dtype == v.dtype):
        return f"dtype {q.dtype}/{k.dtype}/{v.dtype} (wgmma takes bf16 or f16)"
    lane = LANE_BYTES // q.dtype.itemsize
    if q.shape[-1] % lane or v.shape[-1] % lane:
        return f"head dims {q.shape[-1]}/{v.shape[-1]} are not multiples of {lane}"
    if block_size % ROWS:
        return f"block_size {block_size} is not a multiple of {ROWS}"
    if groups > ROWS // 2:
        return f"{groups} heads per kv head (at most {ROWS // 2})"
    need = smem_bytes(q.shape[-1], v.shape[-1], block_size, block_sizes.stages, q.dtype.itemsize)
    if need > SMEM_BYTES:
        return f"{need} bytes of shared memory (at most {SMEM_BYTES}; fewer stages may fit)"
    return None


def group_rows(groups):
    """Gp: G padded to a power of two >= 2, so R = 64 / Gp positions fit one tile's bit mask."""
    return max(2, pl.next_power_of_2(groups))


def union_blocks(idx, positions, num_blocks):
    """Per tile of `positions` consecutive queries, the union of their block lists.

    idx [B,T,K,J] (clean, T a multiple of positions) -> blocks [B,K,T/R,U] (ascending, -1 past
    the count), bits [B,K,T/R,U] int32 (bit r: position r of the tile selected that block),
    count [B,K,T/R]; U = min(R*J, num_blocks).
    """
    b, t, kh, j = idx.shape
    r = positions
    tiles = jnp.transpose(idx.reshape(b, t // r, r, kh, j), (0, 3, 1, 2, 4))  # [B,K,T/R,R,J]
    owner = jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32)[:, None], (r, j))
    # One sort orders by block, then by owner: key = block * R + owner; unused slots last.
    big = jnp.iinfo(jnp.int32).max // (2 * r)
    key = jnp.where(tiles >= 0, tiles, big) * r + owner
    key = jnp.sort(key.reshape(b, kh, t // r, r * j), axis=-1)
    blk, who = key // r, key % r
    used = blk < big
    first = used & jnp.concatenate([jnp.ones_like(used[..., :1]), blk[..., 1:] != blk[..., :-1]], -1)
    slot = jnp.cumsum(first, axis=-1) - 1  # union slot of each sorted entry

    def scatter(slot, first, used, blk, who):
        u = slot.shape[0]
        blocks = jnp.full((u,), -1, jnp.int32).at[jnp.where(first, slot, u)].set(blk, mode="drop")
        # Each (position, block) pair occurs once in a clean list, so adding bits is OR-ing them.
        bits = jnp.zeros((u,), jnp.int32).at[jnp.where(used, slot, u)].add(
            jnp.left_shift(jnp.int32(1), who), mode="drop"
        )
        return blocks, bits

    flat = lambda x: x.reshape(-1, x.shape[-1])
    blocks, bits = jax.vmap(scatter)(*(flat(x) for x in (slot, first, used, blk, who)))
    shape = (b, kh, t // r, r * j)
    u = min(r * j, num_blocks)  # a union has at most every block
    blocks, bits = blocks.reshape(shape)[..., :u], bits.reshape(shape)[..., :u]
    return blocks, bits, jnp.sum(first, axis=-1, dtype=jnp.int32)


def _mma(shape, a, b, *, transpose_b=False, scratch=None):
    """a[M,K] @ b[K,N] (b[N,K]^T when transpose_b) on the tensor core -> float32 [M,N]; a and b
    are shared-memory refs. GPU interpret mode reads operands as stored, so there (scratch given)
    the transpose is written out first; compiled, wgmma reads the transposed ref directly."""
    if transpose_b:
        if scratch is not None:
            scratch[...] = b[...].T
            b = scratch
        else:
            b = b.transpose((1, 0))

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))


# plgpu.load's index: required by jax 0.10, deprecated by 0.11 (which loads the ref as given)
_WHOLE = ((),) if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty else ()


class _Regs:
    """Register layouts: they steer the compiler, and GPU interpret mode has no rule for them."""

    def __init__(self, interpret):
        self.interpret = interpret

    def cast(self, x, layout=plgpu.Layout.WGMMA):
        return x if self.interpret else plgpu.layout_cast(x, layout)

    def iota(self, shape, dim):
        return self.cast(lax.broadcasted_iota(jnp.int32, shape, dim))

    def load(self, ref, layout=plgpu.Layout.WGMMA, optimized=True):
        return ref[...] if self.interpret else plgpu.load(ref, *_WHOLE, layout=layout, optimized=optimized)

    def vector(self, ref, axis):
        """A [64] ref as the per-row (axis 0) or per-column (axis 1) vector of a wgmma tile."""
        return self.load(ref, plgpu.Layout.WGMMA.reduce(1 - axis))


def _visible(bits, row, key, tile, *, gp, s_len, causal, band):
    """Row `row` of tile `tile` may see key `key`: with a selection (band None), a key of a block
    its position picked (bit row // Gp of the union slot's bits); with a band (the window or the
    compressed keys, all bits set), the band's positional rule."""
    if band is not None:
        return band.visible(row, key, tile * band.tq)
    owner = lax.shift_right_logical(row, gp.bit_length() - 1)
    ok = ((lax.shift_right_logical(bits, owner) & 1) == 1) & (key < s_len)
    return ok & (key <= tile * (ROWS // gp) + owner) if causal else ok


def _grid_ids():
    return lax.axis_index("batch"), lax.axis_index("kv_head"), lax.axis_index("tile")


def _stream(count, stages, fetch, free):
    """The memory warpgroup's loop: fill the slots, then refill each once its step is done."""
    for u in range(stages):
        pl.when(u < count)(functools.partial(fetch, u, u))

    @pl.loop(stages, jnp.maximum(count, stages))
    def _(u):
        slot = lax.rem(u, stages)
        for barrier in free:
            plgpu.barrier_wait(barrier.at[slot])
        fetch(u, slot)

    # Wait out the last steps' releases too: GPU interpret mode checks that a thread waiting on a
    # barrier sees every phase of it.
    def drain(step):
        for barrier in free:
            plgpu.barrier_wait(barrier.at[lax.rem(step, stages)])

    for j in range(stages):
        pl.when(count - stages + j >= 0)(functools.partial(drain, count - stages + j))


def _stream_blocks(refs, smem, loaded, free, blocks_ref, ids, count, block_size, stages):
    """Warpgroup 1 of the forward, dQ and scoring kernels: the tile's union blocks of each ref
    (K and V, or K), in order."""
    b, kh, tile = ids

    def fetch(u, slot):
        keys = pl.ds(blocks_ref[b, kh, tile, u] * block_size, block_size)
        for ref, buf, bar in zip(refs, smem, loaded, strict=True):
            plgpu.copy_gmem_to_smem(ref.at[b, kh, keys], buf.at[slot], bar.at[slot])

    pl.when(lax.axis_index("wg") == 1)(functools.partial(_stream, count, stages, fetch, free))


def _fwd_kernel(
    q_ref, k_ref, v_ref, blocks_ref, bits_ref, count_ref, o_ref, lse_ref, scoped,
    *, block_size, stages, interpret, mask,
):
    (q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem, kt), (q_bar, k_bar, v_bar), (k_free, v_free) = scoped
    b, kh, tile = _grid_ids()
    count = count_ref[b, kh, tile]
    rows = pl.ds(tile * ROWS, ROWS)

    @pl.when(lax.axis_index("wg") == 0)
    def _compute():
        plgpu.copy_gmem_to_smem(q_ref.at[b, kh, rows], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)
        regs = _Regs(interpret)
        shape = (ROWS, block_size)
        row, col = regs.iota(shape, 0), regs.iota(shape, 1)
        wide = lambda x: lax.broadcast_in_dim(x, shape, [0])

        def step(u, carry):
            m, l, acc = carry
            slot = lax.rem(u, stages)
            blk = blocks_ref[b, kh, tile, u]
            plgpu.barrier_wait(k_bar.at[slot])
            s = _mma(shape, q_smem, k_smem.at[slot], transpose_b=True, scratch=kt)  # [R*Gp,bs]
            plgpu.barrier_arrive(k_free.at[slot])
            ok = _visible(bits_ref[b, kh, tile, u], row, blk * block_size + col, tile, **mask)
            s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that saw nothing yet
            p = jnp.where(ok, jnp.exp(s - wide(m_safe)), 0.0)
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + p.sum(axis=1)
            # p goes through shared memory and each p.V starts a fresh accumulator (rather than
            # a register operand and ACC.init(acc)): that is what GPU interpret mode can check.
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])
            pv = _mma(o_smem.shape, p_smem, v_smem.at[slot])  # [R*Gp,bs] @ [bs,V]
            plgpu.barrier_arrive(v_free.at[slot])
            return m_new, l, acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv

        reduced = plgpu.Layout.WGMMA.reduce(1)
        init = (
            regs.cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), reduced),
            regs.cast(jnp.zeros((ROWS,), jnp.float32), reduced),
            regs.cast(jnp.zeros(o_smem.shape, jnp.float32)),
        )
        m, l, acc = lax.fori_loop(0, count, step, init)
        seen = l > 0
        l_safe = jnp.where(seen, l, 1.0)
        o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(o_smem.dtype)
        # A row that saw no key gets lse = +inf, so the backward's exp(s - lse) is 0 there.
        lse_smem[...] = jnp.where(seen, m + jnp.log(l_safe), jnp.inf)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, kh, rows])
        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, kh, rows])
        plgpu.wait_smem_to_gmem(0)

    _stream_blocks((k_ref, v_ref), (k_smem, v_smem), (k_bar, v_bar), (k_free, v_free), blocks_ref, (b, kh, tile),
                   count, block_size, stages)


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, blocks_ref, bits_ref, count_ref, dq_ref, scoped,
    *, block_size, stages, interpret, mask, scale,
):
    (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, ds_smem, kt, vt), tile_bar, (k_bar, v_bar), (k_free, v_free) = scoped
    b, kh, tile = _grid_ids()
    count = count_ref[b, kh, tile]
    rows = pl.ds(tile * ROWS, ROWS)

    @pl.when(lax.axis_index("wg") == 0)
    def _compute():
        for i, (ref, smem) in enumerate(((q_ref, q_smem), (do_ref, do_smem), (lse_ref, lse_smem), (delta_ref, delta_smem))):
            plgpu.copy_gmem_to_smem(ref.at[b, kh, rows], smem, tile_bar.at[i])
        for i in range(4):
            plgpu.barrier_wait(tile_bar.at[i])
        regs = _Regs(interpret)
        shape = (ROWS, block_size)
        row, col = regs.iota(shape, 0), regs.iota(shape, 1)
        lse = lax.broadcast_in_dim(regs.vector(lse_smem, 0), shape, [0])
        delta = lax.broadcast_in_dim(regs.vector(delta_smem, 0), shape, [0])

        def step(u, dq):
            slot = lax.rem(u, stages)
            blk = blocks_ref[b, kh, tile, u]
            plgpu.barrier_wait(k_bar.at[slot])
            s = _mma(shape, q_smem, k_smem.at[slot], transpose_b=True, scratch=kt)
            ok = _visible(bits_ref[b, kh, tile, u], row, blk * block_size + col, tile, **mask)
            p = jnp.where(ok, jnp.exp(s - lse), 0.0)
            plgpu.barrier_wait(v_bar.at[slot])
            dp = _mma(shape, do_smem, v_smem.at[slot], transpose_b=True, scratch=vt)
            plgpu.barrier_arrive(v_free.at[slot])
            ds_smem[...] = (p * (dp - delta)).astype(ds_smem.dtype)
            plgpu.commit_smem()
            dq = dq + _mma(q_smem.shape, ds_smem, k_smem.at[slot])  # [R*Gp,bs] @ [bs,H]
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        dq = lax.fori_loop(0, count, step, regs.cast(jnp.zeros(q_smem.shape, jnp.float32)))
        q_smem[...] = (dq * scale).astype(q_smem.dtype)  # q was pre-scaled: d(q*scale)/dq
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[b, kh, rows])
        plgpu.wait_smem_to_gmem(0)

    _stream_blocks((k_ref, v_ref), (k_smem, v_smem), (k_bar, v_bar), (k_free, v_free), blocks_ref, (b, kh, tile),
                   count, block_size, stages)


def _dkdv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, tile_ref, bits_ref, block_ref, lo_ref, hi_ref,
    dk_ref, dv_ref, scoped, *, block_size, stages, interpret, mask,
):
    """One segment of one key block's tile list -> that segment's partial dK, dV (float32)."""
    (k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, pt_smem, dst_smem, dk_smem, dv_smem, qt, dot), kv_bar, loaded, (free,) = scoped
    b, kh, z = _grid_ids()
    c, lo = block_ref[b, kh, z], lo_ref[b, kh, z]
    count = hi_ref[b, kh, z] - lo
    keys = pl.ds(c * block_size, block_size)
    q_bar, do_bar, lse_bar, delta_bar = loaded

    @pl.when((lax.axis_index("wg") == 0) & (count > 0))
    def _compute():
        plgpu.copy_gmem_to_smem(k_ref.at[b, kh, keys], k_smem, kv_bar.at[0])
        plgpu.copy_gmem_to_smem(v_ref.at[b, kh, keys], v_smem, kv_bar.at[1])
        plgpu.barrier_wait(kv_bar.at[0])
        plgpu.barrier_wait(kv_bar.at[1])
        regs = _Regs(interpret)
        shape = (block_size, ROWS)  # transposed: a key per row, a tile row per column
        key, row = c * block_size + regs.iota(shape, 0), regs.iota(shape, 1)
        col = lambda x: lax.broadcast_in_dim(x, shape, [1])

        def step(i, carry):
            dk, dv = carry
            slot = lax.rem(i, stages)
            tile = tile_ref[b, kh, lo + i]
            plgpu.barrier_wait(q_bar.at[slot])
            st = _mma(shape, k_smem, q_smem.at[slot], transpose_b=True, scratch=qt)  # [bs,R*Gp]
            plgpu.barrier_wait(lse_bar.at[slot])
            ok = _visible(bits_ref[b, kh, lo + i], row, key, tile, **mask)
            pt = jnp.where(ok, jnp.exp(st - col(regs.vector(lse_smem.at[slot], 1))), 0.0)
            pt_smem[...] = pt.astype(pt_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(do_bar.at[slot])
            dv = dv + _mma(dv.shape, pt_smem, do_smem.at[slot])  # [bs,R*Gp] @ [R*Gp,V]
            dpt = _mma(shape, v_smem, do_smem.at[slot], transpose_b=True, scratch=dot)
            plgpu.barrier_wait(delta_bar.at[slot])
            dst_smem[...] = (pt * (dpt - col(regs.vector(delta_smem.at[slot], 1)))).astype(dst_smem.dtype)
            plgpu.commit_smem()
            dk = dk + _mma(dk.shape, dst_smem, q_smem.at[slot])  # q was pre-scaled: dk has the scale
            plgpu.barrier_arrive(free.at[slot])
            return dk, dv

        init = (regs.cast(jnp.zeros(dk_smem.shape, jnp.float32)), regs.cast(jnp.zeros(dv_smem.shape, jnp.float32)))
        dk, dv = lax.fori_loop(0, count, step, init)
        dk_smem[...] = dk
        dv_smem[...] = dv
        plgpu.commit_smem()
        part = pl.ds(z * block_size, block_size)
        plgpu.copy_smem_to_gmem(dk_smem, dk_ref.at[b, kh, part])
        plgpu.copy_smem_to_gmem(dv_smem, dv_ref.at[b, kh, part])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(lax.axis_index("wg") == 1)
    def _memory():
        def fetch(i, slot):
            rows = pl.ds(tile_ref[b, kh, lo + i] * ROWS, ROWS)
            for ref, smem, bar in ((q_ref, q_smem, q_bar), (do_ref, do_smem, do_bar), (lse_ref, lse_smem, lse_bar), (delta_ref, delta_smem, delta_bar)):
                plgpu.copy_gmem_to_smem(ref.at[b, kh, rows], smem.at[slot], bar.at[slot])

        _stream(count, stages, fetch, (free,))


def _sum_kernel(dk_part_ref, dv_part_ref, first_ref, count_ref, dk_ref, dv_ref, scoped, *, block_size, interpret):
    """dK, dV of one key block: its segments' partial sums, added in order (deterministic)."""
    (dk_in, dv_in, dk_out, dv_out), bars = scoped
    b, kh, c = _grid_ids()
    first = first_ref[b, kh, c]

    def step(z, carry):
        plgpu.commit_smem()  # the last step's reads of dk_in/dv_in come before TMA rewrites them
        part = pl.ds(z * block_size, block_size)
        plgpu.copy_gmem_to_smem(dk_part_ref.at[b, kh, part], dk_in, bars.at[0])
        plgpu.copy_gmem_to_smem(dv_part_ref.at[b, kh, part], dv_in, bars.at[1])
        plgpu.barrier_wait(bars.at[0])
        plgpu.barrier_wait(bars.at[1])
        # unswizzled float32 tiles: some bank conflicts, on a pass that is a small part of the total
        add = lambda acc, ref: acc + regs.load(ref, optimized=False)
        return add(carry[0], dk_in), add(carry[1], dv_in)

    regs = _Regs(interpret)
    init = (regs.cast(jnp.zeros(dk_in.shape, jnp.float32)), regs.cast(jnp.zeros(dv_in.shape, jnp.float32)))
    dk, dv = lax.fori_loop(first, first + count_ref[b, kh, c], step, init)
    dk_out[...] = dk.astype(dk_out.dtype)
    dv_out[...] = dv.astype(dv_out.dtype)
    plgpu.commit_smem()
    keys = pl.ds(c * block_size, block_size)
    plgpu.copy_smem_to_gmem(dk_out, dk_ref.at[b, kh, keys])
    plgpu.copy_smem_to_gmem(dv_out, dv_ref.at[b, kh, keys])
    plgpu.wait_smem_to_gmem(0)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """A selection's row layout [B,K,Tp*Gp,.] (a tile = 64 contiguous rows: R positions x Gp
    heads), its padded key layout [B,K,Sp,.] (a block = one TMA box) and the tiles' block unions.
    The layouts are _band's: this has the tq (R), groups (Gp) and bk (block) its helpers read."""

    g: Geometry
    groups: int  # Gp

    @classmethod
    def of(cls, g: Geometry):
        return cls(g, group_rows(g.groups))

    @property
    def tq(self):
        return ROWS // self.groups

    @property
    def bk(self):
        return self.g.block_size

    @property
    def t_pad(self):
        return -(-self.g.t_len // self.tq) * self.tq

    def rows(self, x):
        """[B,T,N,X] -> [B,K,Tp*Gp,X], zero-padded."""
        return to_rows(x, x.shape[2] // self.g.groups, self, x.shape[-1])

    def unrows(self, x, n):
        """[B,K,Tp*Gp,X] -> [B,T,N,X]."""
        return from_rows(x, self, (x.shape[0], self.g.t_len, n, x.shape[-1]))

    def keys(self, x):
        """[B,S,K,X] -> [B,K,Sp,X], zero-padded to whole blocks."""
        return to_keys(x, self, x.shape[-1])

    def unions(self, block_idx):
        """The tiles' unions of block_idx's (cleaned) lists: union_blocks."""
        g, r = self.g, self.tq
        idx = clean_block_idx(block_idx, block_size=g.block_size, s_len=g.s_len, causal=g.causal)
        return union_blocks(pad_axis(idx, 1, r, value=-1), r, g.num_blocks)

    def scaled_q(self, q):
        return self.rows((q.astype(jnp.float32) * self.g.scale).astype(q.dtype))

    @property
    def mask(self):
        return {"gp": self.groups, "s_len": self.g.s_len, "causal": self.g.causal, "band": None}


def band_unions(band: Band, batch_heads):
    """A band's tiles as block selections: the consecutive blocks [lo, hi) each tile sees
    (Band.key_tiles), every position 'picking' each (bits -1); the band's mask trims them."""
    lo, hi = band.key_tiles(jnp.arange(band.num_q_tiles, dtype=jnp.int32) * band.tq)
    slot = lo[:, None] + jnp.arange(band.band_k_tiles, dtype=jnp.int32)
    blocks = jnp.where(slot < hi[:, None], slot, -1)
    wide = lambda x: jnp.broadcast_to(x, (*batch_heads, *x.shape))
    return wide(blocks), wide(jnp.full_like(blocks, -1)), wide(jnp.maximum(hi - lo, 0))


def _swizzled(dtype, lane=LANE_BYTES):
    return (plgpu.TilingTransform((8, lane // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(lane))


def _smem(shape, dtype, lane=LANE_BYTES):
    """Shared memory in the wgmma operand layout: rows swizzled over ``lane`` bytes (both
    operands of one wgmma must share it)."""
    return plgpu.SMEM(shape, dtype, transforms=_swizzled(dtype, lane))


def _call(body, out_type, grid, num_threads, scratch, args):
    names = ("tile", "kv_head", "batch")
    return plgpu.kernel(
        lambda *refs: pl.run_scoped(lambda *s: body(*refs, s), *scratch, collective_axes="wg"),
        out_type=out_type,
        grid=grid,
        grid_names=names,
        num_threads=num_threads,
        thread_name="wg",
        interpret=args[1],
    )(*args[0])


def interpret_params(interpret):
    """interpret=True -> GPU interpret mode's parameters (simulated shared memory, TMA, barriers)."""
    if not interpret or not isinstance(interpret, bool):
        return interpret
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _forward_rows(qs, kp, vp, unions, *, block_size, mask, interpret, block_sizes):
    """qs [B,K,Tp*Gp,H] (pre-scaled rows), kp [B,K,Sp,H], vp [B,K,Sp,V] (whole blocks), the
    tiles' unions -> o [B,K,Tp*Gp,V], lse [B,K,Tp*Gp] float32 (+inf where a row saw nothing)."""
    b, kh, rows, h = qs.shape
    vd, bs, stages, dtype = vp.shape[-1], block_size, block_sizes.stages, qs.dtype
    scratch = (
        (
            _smem((ROWS, h), dtype), _smem((stages, bs, h), dtype), _smem((stages, bs, vd), dtype),
            _smem((ROWS, bs), dtype), _smem((ROWS, vd), dtype), plgpu.SMEM((ROWS,), jnp.float32),
            _smem((h, bs), dtype) if interpret else None,
        ),
        (plgpu.Barrier(), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        (plgpu.Barrier(num_barriers=stages),) * 2,
    )
    body = functools.partial(_fwd_kernel, block_size=bs, stages=stages, interpret=bool(interpret), mask=mask)
    return _call(
        body,
        (jax.ShapeDtypeStruct((b, kh, rows, vd), dtype), jax.ShapeDtypeStruct((b, kh, rows), jnp.float32)),
        (rows // ROWS, kh, b), 2, scratch,
        ((qs, kp, vp, *unions), interpret),
    )


def _backward_rows(qs, kp, vp, do, lse, delta, unions, *, block_size, mask, scale, interpret, block_sizes):
    """The rows and keys of _forward_rows, dO rows, lse and delta = rowsum(O * dO) rows -> dq
    rows, dk and dv [B,K,Sp,*]."""
    b, kh, rows, h = qs.shape
    vd, bs, stages, dtype = vp.shape[-1], block_size, block_sizes.stages, qs.dtype
    tiles, num_blocks = rows // ROWS, kp.shape[2] // bs
    blocks, bits, count = unions
    statics = {"block_size": bs, "stages": stages, "interpret": bool(interpret), "mask": mask}
    transposed = lambda *shapes: tuple(_smem(s, dtype) if interpret else None for s in shapes)

    scratch = (
        (
            _smem((ROWS, h), dtype), _smem((ROWS, vd), dtype), plgpu.SMEM((ROWS,), jnp.float32),
            plgpu.SMEM((ROWS,), jnp.float32), _smem((stages, bs, h), dtype), _smem((stages, bs, vd), dtype),
            _smem((ROWS, bs), dtype), *transposed((h, bs), (vd, bs)),
        ),
        plgpu.Barrier(num_barriers=4),
        (plgpu.Barrier(num_barriers=stages),) * 2,
        (plgpu.Barrier(num_barriers=stages),) * 2,
    )
    dq = _call(
        functools.partial(_dq_kernel, **statics, scale=scale),
        jax.ShapeDtypeStruct(qs.shape, dtype), (tiles, kh, b), 2, scratch,
        ((qs, kp, vp, do, lse, delta, blocks, bits, count), interpret),
    )

    # dK/dV: each key block's tiles (the inverted unions), in segments of at most dkdv_tiles
    u = blocks.shape[-1]
    entry, start, end = invert_block_idx(jnp.moveaxis(blocks, 2, 1), num_blocks)
    tile_of = entry // u
    bits_of = jnp.take_along_axis(bits.reshape(b, kh, -1), entry, axis=-1)
    seg_len = block_sizes.dkdv_tiles
    n_seg = -(-tiles * u // seg_len) + num_blocks  # every block may end in a partial segment
    seg_block, seg_lo, seg_hi, seg_first, seg_count = split_csr(start, end, seg_len, n_seg)
    f32 = lambda shape: plgpu.SMEM(shape, jnp.float32)
    scratch = (
        (
            _smem((bs, h), dtype), _smem((bs, vd), dtype), _smem((stages, ROWS, h), dtype),
            _smem((stages, ROWS, vd), dtype), f32((stages, ROWS)), f32((stages, ROWS)),
            _smem((bs, ROWS), dtype), _smem((bs, ROWS), dtype), f32((bs, h)), f32((bs, vd)),
            *transposed((h, ROWS), (vd, ROWS)),
        ),
        plgpu.Barrier(num_barriers=2),
        (plgpu.Barrier(num_barriers=stages),) * 4,
        (plgpu.Barrier(num_barriers=stages),),
    )
    dk_part, dv_part = _call(
        functools.partial(_dkdv_kernel, **statics),
        (jax.ShapeDtypeStruct((b, kh, n_seg * bs, h), jnp.float32), jax.ShapeDtypeStruct((b, kh, n_seg * bs, vd), jnp.float32)),
        (n_seg, kh, b), 2, scratch,
        ((qs, kp, vp, do, lse, delta, tile_of, bits_of, seg_block, seg_lo, seg_hi), interpret),
    )
    scratch = ((f32((bs, h)), f32((bs, vd)), plgpu.SMEM((bs, h), dtype), plgpu.SMEM((bs, vd), dtype)), plgpu.Barrier(num_barriers=2))
    dk, dv = _call(
        functools.partial(_sum_kernel, block_size=bs, interpret=bool(interpret)),
        (jax.ShapeDtypeStruct(kp.shape, dtype), jax.ShapeDtypeStruct(vp.shape, dtype)),
        (num_blocks, kh, b), 1, scratch,
        ((dk_part, dv_part, seg_first, seg_count), interpret),
    )
    return dq, dk, dv


def select_forward_mgpu(q, k, v, block_idx, g: Geometry, interpret=False, block_sizes=BlockSizes()):
    """-> (o [B,T,N,V], lse [B,K,T,G] float32 of the scaled scores)."""
    b, _, n, _ = q.shape
    lay = _Layout.of(g)
    o, lse = _forward_rows(
        lay.scaled_q(q), lay.keys(k), lay.keys(v), lay.unions(block_idx),
        block_size=g.block_size, mask=lay.mask, interpret=interpret, block_sizes=block_sizes,
    )
    lse = lse.reshape(b, k.shape[2], lay.t_pad, lay.groups)[:, :, : g.t_len, : g.groups]
    return lay.unrows(o, n), lse


def select_backward_mgpu(q, k, v, block_idx, out, lse, dout, g: Geometry, interpret=False, block_sizes=BlockSizes()):
    """lse [B,K,T,G] from select_forward_mgpu, dout [B,T,N,V] -> dq, dk, dv."""
    b, _, n, _ = q.shape
    lay = _Layout.of(g)
    delta = lay.rows(jnp.einsum("btnv,btnv->btn", out.astype(jnp.float32), dout.astype(jnp.float32))[..., None])[..., 0]
    lse = pad_axis(pad_axis(lse, 2, lay.t_pad, value=jnp.inf), 3, lay.groups, value=jnp.inf)  # padded rows see nothing
    dq, dk, dv = _backward_rows(
        lay.scaled_q(q), lay.keys(k), lay.keys(v), lay.rows(dout), lse.reshape(b, k.shape[2], -1), delta,
        lay.unions(block_idx), block_size=g.block_size, mask=lay.mask, scale=g.scale, interpret=interpret,
        block_sizes=block_sizes,
    )
    return lay.unrows(dq, n), from_keys(dk, k.shape), from_keys(dv, v.shape)


# Bands (the window, the compressed keys) on the same kernels: a tile's band of 64-key blocks is
# its selection and Band.visible its mask. _band.band_attention makes them differentiable.


def mosaic_band(q, k, *, window, scale, block_sizes, stride=1, first=0):
    """The Band of these kernels' tiles: R = 64 / Gp positions x Gp heads, key blocks of 64."""
    gp = group_rows(q.shape[2] // k.shape[2])
    return Band.of(q, k, window=window, scale=scale, groups=gp, tq=ROWS // gp, bk=ROWS, block_sizes=block_sizes,
                   stride=stride, first=first)


def band_mask(band: Band):
    return {"gp": band.groups, "s_len": band.s_len, "causal": True, "band": band}


def band_layout(q, k, v, band: Band):
    """-> pre-scaled q rows, k and v in whole blocks."""
    qs = (q.astype(jnp.float32) * band.scale).astype(q.dtype)
    return to_rows(qs, k.shape[2], band, q.shape[-1]), to_keys(k, band, k.shape[-1]), to_keys(v, band, v.shape[-1])


def band_forward(qr, kt, vt, band: Band, interpret):
    return _forward_rows(qr, kt, vt, band_unions(band, qr.shape[:2]), block_size=band.bk, mask=band_mask(band),
                         interpret=interpret, block_sizes=band.block_sizes)


def band_backward(qr, kt, vt, do, lse, delta, band: Band, interpret):
    return _backward_rows(qr, kt, vt, do, lse, delta, band_unions(band, qr.shape[:2]), block_size=band.bk,
                          mask=band_mask(band), scale=band.scale, interpret=interpret, block_sizes=band.block_sizes)


_window = band_attention(band_layout, band_forward, band_backward)


def sliding_window_attention_mgpu(q, k, v, *, window, scale=None, interpret=False, block_sizes=BlockSizes()):
    """NSA's window branch on these kernels (the contract of sliding_window_attention)."""
    band = mosaic_band(q, k, window=window, scale=scale, block_sizes=block_sizes)
    return _window(q, k, v, band, interpret_params(interpret))
