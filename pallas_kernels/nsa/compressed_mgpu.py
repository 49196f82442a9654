"""NSA's compressed branch and block scoring for Hopper, Pallas' Mosaic GPU backend.

The compressed branch is a band (key i at position i*d + l - 1, no window), so its attention,
dQ and dK/dV run select_mgpu's kernels: each 64-row tile (R positions x Gp heads) walks the
64-key blocks of compressed keys its positions see. What selection needs besides is each
query's block importance (eqs. 8-10): the probabilities summed over the GQA group, mapped onto
selection blocks by eq. 9. The scoring kernel recomputes p = exp(s - lse) per block of 64
compressed keys from the forward's log-sum-exp and writes only the [T, K, P] importance:
- the group sum is a wgmma with a 0/1 selector [64, 64 rows] whose first R rows pick each
  position's real heads (the other rows are zero: a wgmma has 64 rows);
- eq. 9 is a wgmma with the constant weights [64 keys, 64 / (l'/d)] of the block's own
  selection blocks, plus one with the previous block's group sums for the l/d - 1 blocks that
  spill into this block's first selection block;
- probabilities and group sums enter the tensor core as bf16 pairs hi + lo (x = hi + lo to
  2^-17), so the importance is as exact as float32 sums, where bf16 alone would err by 2^-9.

Letters: B batch, T query time, C compressed blocks, N query heads, K kv heads, G heads per kv
head (Gp padded), H key head dim, V value head dim, R positions per tile, P selection blocks,
W selection blocks per 64 compressed keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.nsa._band import Band, band_attention
from pallas_kernels.nsa._scoring import Scoring, eq9_tile_weights, group_selector
from pallas_kernels.nsa.select_mgpu import (
    ROWS,
    SMEM_BYTES,
    BlockSizes,
    _call,
    _grid_ids,
    _mma,
    _Regs,
    _smem,
    _stream_blocks,
    band_backward,
    band_forward,
    band_layout,
    band_unions,
    interpret_params,
    mosaic_band,
    supports,
)
from pallas_kernels.nsa.xla import NSAShape

# Compressed keys' inverted lists are long (every later tile sees a key block), so a dK/dV program
# walks more tiles than a selection's before its partial sum is cut off.
DEFAULT = BlockSizes(dkdv_tiles=256)


def scores_smem_bytes(h, stages, per, itemsize=2):
    """Shared memory of the scoring kernel: q, k slots, p and two group sums as hi/lo pairs,
    the selector, the eq. 9 weights, two float32 output slots and lse."""
    tiles = ROWS * h + stages * ROWS * h + 2 * ROWS * ROWS + 4 * ROWS * ROWS + ROWS * ROWS + 2 * ROWS * per
    return tiles * itemsize + 2 * ROWS * per * 4 + ROWS * 4


def compressed_supports(q, k_cmp, v_cmp, shape: NSAShape, block_sizes=DEFAULT) -> str | None:
    """Why these kernels cannot take these inputs, or None when they can."""
    if (why := supports(q, k_cmp, v_cmp, ROWS, block_sizes)) is not None:
        return why
    ratio, span = shape.select_block // shape.compress_stride, shape.compress_block // shape.compress_stride
    if ROWS % ratio or ROWS // ratio < 16:  # eq. 9's wgmma: N = 64 / ratio, rows of >= 32 bytes
        return f"select_block / compress_stride = {ratio} does not divide {ROWS} into 16 or more"
    if span > ROWS:
        return f"compress_block / compress_stride = {span} spills past one block of {ROWS} compressed keys"
    if (need := scores_smem_bytes(q.shape[-1], block_sizes.stages, ROWS // ratio, q.dtype.itemsize)) > SMEM_BYTES:
        return f"{need} bytes of shared memory for scoring (at most {SMEM_BYTES})"
    return None


def _scores_kernel(
    q_ref, k_ref, lse_ref, sel_ref, w_own_ref, w_prev_ref, blocks_ref, count_ref, out_ref, scoped,
    *, band: Band, chunks, stages, interpret,
):
    (q_smem, lse_smem, sel_smem, w_own, w_prev, k_smem, p_smem, g_smem, imp_smem, kt), tile_bar, (k_bar,), (k_free,) = scoped
    b, kh, tile = _grid_ids()
    count = jnp.minimum(count_ref[b, kh, tile], chunks)  # blocks past the P selection blocks feed none
    rows, r, per = pl.ds(tile * ROWS, ROWS), band.tq, w_own.shape[-1]

    @pl.when(lax.axis_index("wg") == 0)
    def _compute():
        for i, (ref, smem) in enumerate(((q_ref, q_smem), (lse_ref, lse_smem))):
            plgpu.copy_gmem_to_smem(ref.at[b, kh, rows], smem, tile_bar.at[i])
        for i, (ref, smem) in enumerate(((sel_ref, sel_smem), (w_own_ref, w_own), (w_prev_ref, w_prev)), 2):
            plgpu.copy_gmem_to_smem(ref, smem, tile_bar.at[i])
        regs = _Regs(interpret)
        shape = (ROWS, ROWS)
        zeros = regs.cast(jnp.zeros(shape, g_smem.dtype))
        for half in range(2):  # the group sums "before" block 0
            g_smem.at[1, half][...] = zeros
        plgpu.commit_smem()
        for i in range(5):
            plgpu.barrier_wait(tile_bar.at[i])
        row, col = regs.iota(shape, 0), regs.iota(shape, 1)
        lse = lax.broadcast_in_dim(regs.vector(lse_smem, 0), shape, [0])

        def split(x, pair):
            """x (float32) -> pair[0] + pair[1] in bf16/f16, x to 2^-17 (relative)."""
            hi = x.astype(pair.dtype)
            pair.at[0][...] = hi
            pair.at[1][...] = (x - hi.astype(jnp.float32)).astype(pair.dtype)
            plgpu.commit_smem()

        def dot2(pair, rhs, n):
            return _mma((ROWS, n), pair.at[0], rhs) + _mma((ROWS, n), pair.at[1], rhs)

        def emit(c, imp):
            """The importance of chunk c (rows :R real) -> out[b, kh, tile, c]."""
            slot = lax.rem(c, 2)
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from this slot is done
            imp_smem.at[slot][...] = imp
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(imp_smem.at[slot, pl.ds(0, r)], out_ref.at[b, kh, tile, c])

        def step(u, carry):
            slot = lax.rem(u, stages)
            blk = blocks_ref[b, kh, tile, u]
            plgpu.barrier_wait(k_bar.at[slot])
            s = _mma(shape, q_smem, k_smem.at[slot], transpose_b=True, scratch=kt)
            plgpu.barrier_arrive(k_free.at[slot])
            ok = band.visible(row, blk * ROWS + col, tile * r)
            split(jnp.where(ok, jnp.exp(s - lse), 0.0), p_smem)
            cur = g_smem.at[lax.rem(u, 2)]
            split(_mma(shape, sel_smem, p_smem.at[0]) + _mma(shape, sel_smem, p_smem.at[1]), cur)
            emit(u, dot2(cur, w_own, per) + dot2(g_smem.at[lax.rem(u + 1, 2)], w_prev, per))
            return carry

        lax.fori_loop(0, count, step, 0)

        @pl.when((count > 0) & (count < chunks))
        def _spill():  # the chunk after the last block: only the last block's spill
            emit(count, dot2(g_smem.at[lax.rem(count + 1, 2)], w_prev, per))

        plgpu.wait_smem_to_gmem(0)

    _stream_blocks((k_ref,), (k_smem,), (k_bar,), (k_free,), blocks_ref, (b, kh, tile), count, ROWS, stages)


def _scores(qr, kt, lse, band: Band, interpret, *, scoring: Scoring):
    """qr [B,K,Tp*Gp,H] (pre-scaled), kt [B,K,Cp,H], lse [B,K,Tp*Gp] -> importance [B,T,K,P]."""
    b, kh, rows, h = qr.shape
    dtype, stages = qr.dtype, band.block_sizes.stages
    per, chunks = scoring.tiles(ROWS)
    tiles, r = rows // ROWS, band.tq
    blocks, _, count = band_unions(band, (b, kh))
    sel = jnp.pad(group_selector(band, scoring.heads), ((0, ROWS - r), (0, 0))).astype(dtype)
    w_own, w_prev = (eq9_tile_weights(scoring, ROWS, prev).astype(dtype) for prev in (False, True))
    narrow = per * dtype.itemsize  # eq. 9's wgmma: [64, 64] group sums x [64, W] weights, both swizzled to W's rows
    scratch = (
        (
            _smem((ROWS, h), dtype), plgpu.SMEM((ROWS,), jnp.float32), _smem((ROWS, ROWS), dtype),
            _smem((ROWS, per), dtype, narrow), _smem((ROWS, per), dtype, narrow), _smem((stages, ROWS, h), dtype),
            _smem((2, ROWS, ROWS), dtype), _smem((2, 2, ROWS, ROWS), dtype, narrow),
            plgpu.SMEM((2, ROWS, per), jnp.float32), _smem((h, ROWS), dtype) if interpret else None,
        ),
        plgpu.Barrier(num_barriers=5),
        (plgpu.Barrier(num_barriers=stages),),
        (plgpu.Barrier(num_barriers=stages),),
    )
    body = functools.partial(_scores_kernel, band=band, chunks=chunks, stages=stages, interpret=bool(interpret))
    out = _call(
        body, jax.ShapeDtypeStruct((b, kh, tiles, chunks, r, per), jnp.float32), (tiles, kh, b), 2, scratch,
        ((qr, kt, lse, sel, w_own, w_prev, blocks, count), interpret),
    )
    # Chunks past a tile's blocks (and its spill) were never written.
    count = jnp.minimum(count, chunks)
    written = jnp.where(count > 0, jnp.minimum(count + 1, chunks), 0)
    out = jnp.where(jnp.arange(chunks)[:, None, None] < written[..., None, None, None], out, 0.0)
    out = jnp.transpose(out, (0, 1, 2, 4, 3, 5)).reshape(b, kh, tiles * r, chunks * per)
    return jnp.transpose(out[:, :, : band.t_len, : scoring.num_blocks], (0, 2, 1, 3))


@functools.cache
def _compressed(scoring: Scoring):
    return band_attention(band_layout, band_forward, band_backward, extra=functools.partial(_scores, scoring=scoring))


def compressed_attention_mgpu(
    q, k_cmp, v_cmp, *, shape: NSAShape, num_select_blocks, scale=None, interpret=False, block_sizes=DEFAULT
):
    """The compressed branch on Hopper; the contract of compressed_attention (offset 0)."""
    scoring = Scoring(shape, int(num_select_blocks), q.shape[2] // k_cmp.shape[2])
    band = mosaic_band(q, k_cmp, window=None, scale=scale, block_sizes=block_sizes,
                       stride=shape.compress_stride, first=shape.compress_block - 1)
    return _compressed(scoring)(q, k_cmp, v_cmp, band, interpret_params(interpret))
