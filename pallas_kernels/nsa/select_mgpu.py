"""Selected-block attention forward for Hopper, Pallas' Mosaic GPU backend (TMA + wgmma).

A wgmma takes 64 rows, and one position's GQA group has G <= 16 heads, so the paper's
one-position-per-program design would waste 4x the tensor core and reload the same key blocks
for every neighbouring position. Neighbouring queries pick mostly the same blocks (their local
blocks and top-scoring ones agree), so a program here owns a tile of R = 64 / Gp consecutive
positions x Gp heads and walks the *union* of their selected blocks once, each row masked to
the blocks its own position picked (a bit per position, precomputed with the union). A memory
warpgroup streams the union's key/value blocks through ``stages`` shared-memory slots with TMA
while the compute warpgroup runs the online softmax over them. The backward stays in
``select_gpu`` (it reads this kernel's lse).

Letters: B batch, T query time, K kv heads, G heads per kv head (Gp padded to a power of two),
H key head dim, V value head dim, J selected-block slots, R positions per tile, U union slots.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.nsa._index import Geometry, clean_block_idx, pad_axis

ROWS = 64  # one warpgroup's wgmma M
LANE_BYTES = 128  # swizzle width: the head dims must fill whole 128-byte rows


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    stages: int = 3  # key/value blocks in flight (shared-memory slots)


def supports(q, k, v, block_size) -> str | None:
    """Why this kernel cannot take these inputs, or None when it can."""
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
    return None


def group_rows(groups):
    """Gp: G padded to a power of two >= 2, so R = 64 / Gp positions fit one tile's bit mask."""
    return max(2, pl.next_power_of_2(groups))


def union_blocks(idx, positions):
    """Per tile of `positions` consecutive queries, the union of their block lists.

    idx [B,T,K,J] (clean, T a multiple of positions) -> blocks [B,K,T/R,U] (ascending, -1 past
    the count), bits [B,K,T/R,U] int32 (bit r: position r of the tile selected that block),
    count [B,K,T/R]; U = R*J.
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
    return blocks.reshape(shape), bits.reshape(shape), jnp.sum(first, axis=-1, dtype=jnp.int32)


def _kernel(
    q_ref, k_ref, v_ref, blocks_ref, bits_ref, count_ref, o_ref, lse_ref, scoped,
    *, gp, block_size, s_len, causal, stages, interpret,
):
    (q_smem, k_smem, v_smem, p_smem, o_smem, lse_smem), (q_bar, k_bar, v_bar), (k_free, v_free) = scoped
    tile, kh, b = lax.axis_index("tile"), lax.axis_index("kv_head"), lax.axis_index("batch")
    count = count_ref[b, kh, tile]
    rows = pl.ds(tile * ROWS, ROWS)
    positions = ROWS // gp

    @pl.when(lax.axis_index("wg") == 0)
    def _compute():
        plgpu.copy_gmem_to_smem(q_ref.at[b, kh, rows], q_smem, q_bar)
        plgpu.barrier_wait(q_bar)
        # Register layouts steer the compiler; GPU interpret mode has no rule for them.
        cast = (lambda x, layout: x) if interpret else plgpu.layout_cast
        shape = (ROWS, block_size)
        row = cast(lax.broadcasted_iota(jnp.int32, shape, 0), plgpu.Layout.WGMMA)
        col = cast(lax.broadcasted_iota(jnp.int32, shape, 1), plgpu.Layout.WGMMA)
        owner = lax.shift_right_logical(row, gp.bit_length() - 1)  # row // Gp
        pos = tile * positions + owner
        wide = lambda x: lax.broadcast_in_dim(x, shape, [0])

        def step(u, carry):
            m, l, acc = carry
            slot = lax.rem(u, stages)
            blk = blocks_ref[b, kh, tile, u]
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot])  # [R*Gp,H] @ [H,bs]
                return acc_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC(shape, jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            key = blk * block_size + col
            ok = (lax.shift_right_logical(bits_ref[b, kh, tile, u], owner) & 1) == 1
            ok = ok & (key < s_len)
            if causal:
                ok = ok & (key <= pos)
            s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that saw nothing yet
            p = jnp.where(ok, jnp.exp(s - wide(m_safe)), 0.0)
            alpha = jnp.exp(m - m_safe)
            l = alpha * l + p.sum(axis=1)
            # p goes through shared memory and the accumulator starts fresh (rather than a
            # register operand and ACC.init(acc)): that is what GPU interpret mode can check.
            p_smem[...] = p.astype(p_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_wait(v_bar.at[slot])

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])  # [R*Gp,bs] @ [bs,V]
                return acc_ref[...]

            pv = pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
            plgpu.barrier_arrive(v_free.at[slot])
            return m_new, l, acc

        reduced = plgpu.Layout.WGMMA.reduce(1)
        init = (
            cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), reduced),
            cast(jnp.zeros((ROWS,), jnp.float32), reduced),
            cast(jnp.zeros((ROWS, o_smem.shape[-1]), jnp.float32), plgpu.Layout.WGMMA),
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

    @pl.when(lax.axis_index("wg") == 1)
    def _memory():
        def fetch(u, slot):
            keys = pl.ds(blocks_ref[b, kh, tile, u] * block_size, block_size)
            plgpu.copy_gmem_to_smem(k_ref.at[b, kh, :, keys], k_smem.at[slot], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[b, kh, keys], v_smem.at[slot], v_bar.at[slot])

        for u in range(stages):
            pl.when(u < count)(functools.partial(fetch, u, u))

        @pl.loop(stages, jnp.maximum(count, stages))
        def _(u):
            slot = lax.rem(u, stages)
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
            fetch(u, slot)


def select_forward_mgpu(q, k, v, block_idx, g: Geometry, interpret=False, block_sizes=BlockSizes()):
    """-> (o [B,T,N,V], lse [B,K,T,G] float32), the scale already applied."""
    b, t, n, h = q.shape
    kh, vd = k.shape[2], v.shape[-1]
    gp = group_rows(g.groups)
    r = ROWS // gp
    idx = clean_block_idx(block_idx, block_size=g.block_size, s_len=g.s_len, causal=g.causal)
    idx = pad_axis(idx, 1, r, value=-1)
    tp = idx.shape[1]
    blocks, bits, count = union_blocks(idx, r)
    # Row layout [B,K,T*Gp,.]: a tile is 64 contiguous rows (R positions x Gp heads).
    qg = (q.astype(jnp.float32) * g.scale).astype(q.dtype).reshape(b, t, kh, g.groups, h)
    qg = pad_axis(pad_axis(qg, 1, r), 3, gp)
    qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(b, kh, tp * gp, h)
    # K^T [B,K,H,S] and V [B,K,S,V]: a block is one TMA box and both wgmmas take plain operands.
    kt = jnp.transpose(pad_axis(k, 1, g.block_size), (0, 2, 3, 1))
    vt = jnp.transpose(pad_axis(v, 1, g.block_size), (0, 2, 1, 3))
    stages = block_sizes.stages
    swizzled = (plgpu.TilingTransform((8, LANE_BYTES // q.dtype.itemsize)), plgpu.SwizzleTransform(LANE_BYTES))

    def entry(q_ref, k_ref, v_ref, blocks_ref, bits_ref, count_ref, o_ref, lse_ref):
        smem = (
            plgpu.SMEM((ROWS, h), q.dtype, transforms=swizzled),
            plgpu.SMEM((stages, h, g.block_size), k.dtype, transforms=swizzled),
            plgpu.SMEM((stages, g.block_size, vd), v.dtype, transforms=swizzled),
            plgpu.SMEM((ROWS, g.block_size), q.dtype, transforms=swizzled),
            plgpu.SMEM((ROWS, vd), q.dtype, transforms=swizzled),
            plgpu.SMEM((ROWS,), jnp.float32),
        )
        loaded = (plgpu.Barrier(), plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages))
        freed = (plgpu.Barrier(num_barriers=stages),) * 2
        body = functools.partial(
            _kernel, q_ref, k_ref, v_ref, blocks_ref, bits_ref, count_ref, o_ref, lse_ref,
            gp=gp, block_size=g.block_size, s_len=g.s_len, causal=g.causal, stages=stages,
            interpret=bool(interpret),
        )
        pl.run_scoped(lambda *scoped: body(scoped), smem, loaded, freed, collective_axes="wg")

    o, lse = plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((b, kh, tp * gp, vd), q.dtype),
            jax.ShapeDtypeStruct((b, kh, tp * gp), jnp.float32),
        ),
        grid=(tp // r, kh, b),
        grid_names=("tile", "kv_head", "batch"),
        num_threads=2,
        thread_name="wg",
        interpret=interpret,
    )(qg, kt, vt, blocks, bits, count)
    o = jnp.transpose(o.reshape(b, kh, tp, gp, vd)[:, :, :t, : g.groups], (0, 2, 1, 3, 4))
    return o.reshape(b, t, n, vd), lse.reshape(b, kh, tp, gp)[:, :, :t, : g.groups]
