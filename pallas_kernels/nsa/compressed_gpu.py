"""NSA's compressed branch and block scoring, GPU-style Pallas kernels (Triton lowering).

The compressed branch (eq. 7) is banded flash attention with key i at position i*d + l - 1 and
no window (``Band(stride=d, first=l-1, window=None)``), so it runs the window file's forward,
dQ and dK/dV kernels. Selection needs one more thing from the same softmax: each query's block
importance (eqs. 8-10), the probabilities summed over the GQA group and mapped onto selection
blocks. Materialising p_cmp [T, N, C] for that is what made the XLA layer slow at long context
(45 of its 52 ms at 64k on an H100); here a scoring kernel recomputes p = exp(s - lse) per tile
from the forward's log-sum-exp and writes only the [T, K, P] importance:
- one program per (batch, kv head, query tile) walks the compressed tiles its queries see;
- the group sum is a dot with a 0/1 selector [tq, R] (rows are query-major, t * Gp + g);
- eq. 9 is a dot with the constant weights W[i, j] = eq9_weight(i - (l'/d) j): a tile of bk
  compressed blocks fills bk / (l'/d) selection blocks, and the first of them also takes the
  last l/d - 1 blocks of the previous tile (carried in the loop, a second dot).

Letters: B batch, T query time, C compressed blocks, N query heads, K kv heads, G heads per kv
head, H key head dim, V value head dim, R rows of a query tile, P selection blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.nsa import compressed_mgpu
from pallas_kernels.nsa._band import Band, band_attention
from pallas_kernels.nsa._scoring import Scoring, eq9_tile_weights, group_selector
from pallas_kernels.nsa.select_gpu import MIN_DOT_ROWS, _pow2
from pallas_kernels.nsa.window_gpu import _backward, _forward, _layout, _params
from pallas_kernels.nsa.xla import NSAShape


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 256  # rows per query tile: max(block_q, 16 * Gp) // Gp positions (>= 16: the group-sum dot)
    block_k: int = 64  # compressed blocks per tile: a multiple of l'/d; bk / (l'/d) >= 16 compiled
    num_warps: int = 8
    num_stages: int = 2
    # "mosaic": compressed_mgpu's Hopper kernels where they take the inputs, else these. Opt-in
    # until a lent H100 has compiled and timed them.
    backend: str = "triton"
    mosaic: compressed_mgpu.BlockSizes = compressed_mgpu.DEFAULT


def _scores_kernel(q_ref, k_ref, lse_ref, out_ref, *, band: Band, scoring: Scoring):
    q0 = pl.program_id(2) * band.tq
    q = (q_ref[...].astype(jnp.float32) * band.scale).astype(k_ref.dtype)  # as the forward's dots
    lse = lse_ref[...]
    row = jnp.arange(band.rows)[:, None]
    per, tiles = scoring.tiles(band.bk)
    select = group_selector(band, scoring.heads)
    w_own, w_prev = eq9_tile_weights(scoring, band.bk, False), eq9_tile_weights(scoring, band.bk, True)
    exact = functools.partial(plgpu.dot, allow_tf32=False)  # sums of probabilities: keep fp32

    def body(c, prev):
        start = c * band.bk
        ok = band.visible(row, start + jnp.arange(band.bk)[None, :], q0)
        p = jnp.where(ok, jnp.exp(plgpu.dot(q, k_ref[pl.ds(start, band.bk), :].T) - lse[:, None]), 0.0)
        group = exact(select, p)  # [tq, bk]
        out_ref[:, pl.ds(c * per, per)] = exact(group, w_own) + exact(prev, w_prev)
        return group

    # tile hi sees nothing itself but takes the spill of tile hi - 1
    last = jnp.minimum(band.key_tiles(q0)[1] + 1, tiles)
    jax.lax.fori_loop(0, last, body, jnp.zeros((band.tq, band.bk), jnp.float32))

    def zero(c, carry):
        out_ref[:, pl.ds(c * per, per)] = jnp.zeros((band.tq, per), jnp.float32)
        return carry

    jax.lax.fori_loop(last, tiles, zero, 0)


def _scores(qr, k, lse, band: Band, interpret, *, scoring: Scoring):
    """qr [B,K,Tp*Gp,H], k [B,K,Cp,H], lse [B,K,Tp*Gp] -> importance [B,T,K,P]."""
    b, kh, tr, hp = qr.shape
    per, tiles = scoring.tiles(band.bk)
    k = jnp.pad(k, ((0, 0), (0, 0), (0, max(tiles * band.bk - k.shape[2], 0)), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_scores_kernel, band=band, scoring=scoring),
        grid=(b, kh, band.num_q_tiles),
        in_specs=[
            pl.BlockSpec((None, None, band.rows, hp), lambda i, j, r: (i, j, r, 0)),
            pl.BlockSpec((None, None, k.shape[2], hp), lambda i, j, r: (i, j, 0, 0)),
            pl.BlockSpec((None, None, band.rows), lambda i, j, r: (i, j, r)),
        ],
        out_specs=pl.BlockSpec((None, None, band.tq, tiles * per), lambda i, j, r: (i, j, r, 0)),
        out_shape=jax.ShapeDtypeStruct((b, kh, tr // band.groups, tiles * per), jnp.float32),
        compiler_params=_params(band),
        interpret=interpret,
        name="nsa_compressed_scores",
    )(qr, k, lse)
    return jnp.transpose(out[:, :, : band.t_len, : scoring.num_blocks], (0, 2, 1, 3))


@functools.cache
def _compressed(scoring: Scoring):
    return band_attention(_layout, _forward, _backward, extra=functools.partial(_scores, scoring=scoring))


def compressed_attention_gpu(
    q, k_cmp, v_cmp, *, shape: NSAShape, num_select_blocks, scale=None, interpret=False, block_sizes=BlockSizes()
):
    """GPU-style compressed branch; same contract as compressed_attention_reference (offset 0)."""
    if block_sizes.backend == "mosaic" and compressed_mgpu.compressed_supports(q, k_cmp, v_cmp, shape, block_sizes.mosaic) is None:
        return compressed_mgpu.compressed_attention_mgpu(
            q, k_cmp, v_cmp, shape=shape, num_select_blocks=num_select_blocks, scale=scale, interpret=interpret,
            block_sizes=block_sizes.mosaic,
        )
    scoring = Scoring(shape, int(num_select_blocks), q.shape[2] // k_cmp.shape[2])
    gp = _pow2(q.shape[2] // k_cmp.shape[2])
    rows = max(block_sizes.block_q, MIN_DOT_ROWS * gp)
    band = Band.of(
        q, k_cmp, window=None, scale=scale, groups=gp, tq=rows // gp, bk=scoring.check_tile(block_sizes.block_k),
        block_sizes=block_sizes, stride=shape.compress_stride, first=shape.compress_block - 1,
    )
    return _compressed(scoring)(q, k_cmp, v_cmp, band, interpret)
