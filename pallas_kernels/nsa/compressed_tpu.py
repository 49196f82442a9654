"""NSA's compressed branch and block scoring, TPU-style Pallas kernels (Mosaic TPU).

As in compressed_gpu.py: the branch itself is the window file's banded flash attention with
key i at position i*d + l - 1 and no window; the scoring kernel recomputes the probabilities
from the forward's log-sum-exp and writes each query's group importance per selection block.
Here the scoring grid is (batch, kv head, query tile, compressed tile), the last axis
"arbitrary": each step writes its own [tq, bk / (l'/d)] output tile (lane-dense with the default
bk = 128 * l'/d) and keeps its group-summed probabilities in VMEM for the next step, whose first
selection block takes the last l/d - 1 of them. Steps past the query tile's causal reach write
zeros and re-use the last fetched key tile.

Letters: B batch, T query time, C compressed blocks, N query heads, K kv heads, G heads per kv
head, H key head dim, R rows of a query tile, P selection blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.nsa._band import Band, band_attention
from pallas_kernels.nsa._scoring import Scoring, eq9_tile_weights, group_selector
from pallas_kernels.nsa.select_tpu import _interpret
from pallas_kernels.nsa.window_tpu import (
    _backward,
    _forward,
    _layout,
    _mask,
    _params,
    _tiles,
)
from pallas_kernels.nsa.xla import NSAShape


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 64  # query positions per tile (a tile holds block_q * G rows)
    block_k: int | None = None  # compressed blocks per tile; None: 128 selection blocks' worth


def _scores_kernel(q_ref, k_ref, lse_ref, out_ref, prev_sc, *, band: Band, scoring: Scoring):
    r, c = pl.program_id(2), pl.program_id(3)
    reach = band.key_tiles(r * band.tq)[1]  # tile `reach` sees nothing but takes the spill of reach - 1

    @pl.when(c == 0)
    def _init():
        prev_sc[...] = jnp.zeros(prev_sc.shape, jnp.float32)

    @pl.when(c <= reach)
    def _step():
        q = q_ref[...].astype(jnp.float32) * band.scale  # [R,H]
        ok = _mask(band, r * band.tq, c * band.bk)
        p = jnp.where(ok, jnp.exp(jnp.dot(q, k_ref[...].astype(jnp.float32).T) - lse_ref[...]), 0.0)
        group = jnp.dot(group_selector(band, scoring.heads), p)  # [tq,bk]
        out_ref[...] = (jnp.dot(group, eq9_tile_weights(scoring, band.bk, False))
                        + jnp.dot(prev_sc[...], eq9_tile_weights(scoring, band.bk, True)))
        prev_sc[...] = group

    @pl.when(c > reach)
    def _past():
        out_ref[...] = jnp.zeros(out_ref.shape, jnp.float32)


def _scores(qr, k, lse, band: Band, interpret, *, scoring: Scoring):
    """qr [B,K,Tp*G,H], k [B,K,Cp,H], lse [B,K,Tp*G,1] -> importance [B,T,K,P]."""
    b, kh, tr, hd = qr.shape
    per, tiles = scoring.tiles(band.bk)
    k = jnp.pad(k, ((0, 0), (0, 0), (0, max(tiles * band.bk - k.shape[2], 0)), (0, 0)))
    keys = lambda r, c: jnp.minimum(c, band.key_tiles(r * band.tq)[1])
    own = lambda r, c: r
    out = pl.pallas_call(
        functools.partial(_scores_kernel, band=band, scoring=scoring),
        grid=(b, kh, band.num_q_tiles, tiles),
        in_specs=[_tiles(band.rows, hd, own), _tiles(band.bk, hd, keys), _tiles(band.rows, None, own)],
        out_specs=pl.BlockSpec((None, None, band.tq, per), lambda i, j, r, c: (i, j, r, c)),
        out_shape=jax.ShapeDtypeStruct((b, kh, tr // band.groups, tiles * per), jnp.float32),
        scratch_shapes=[pltpu.VMEM((band.tq, band.bk), jnp.float32)],
        compiler_params=_params(),
        interpret=_interpret(interpret),
        name="nsa_compressed_scores_tpu",
    )(qr, k, lse)
    return jnp.transpose(out[:, :, : band.t_len, : scoring.num_blocks], (0, 2, 1, 3))


@functools.cache
def _compressed(scoring: Scoring):
    return band_attention(_layout, _forward, _backward, extra=functools.partial(_scores, scoring=scoring))


def compressed_attention_tpu(
    q, k_cmp, v_cmp, *, shape: NSAShape, num_select_blocks, scale=None, interpret=False, block_sizes=BlockSizes()
):
    """TPU-style compressed branch; same contract as compressed_attention_reference (offset 0)."""
    groups = q.shape[2] // k_cmp.shape[2]
    scoring = Scoring(shape, int(num_select_blocks), groups)
    bk = scoring.check_tile(block_sizes.block_k or 128 * scoring.ratio)
    band = Band.of(
        q, k_cmp, window=None, scale=scale, groups=groups, tq=block_sizes.block_q, bk=bk,
        block_sizes=block_sizes, stride=shape.compress_stride, first=shape.compress_block - 1,
    )
    return _compressed(scoring)(q, k_cmp, v_cmp, band, interpret)
