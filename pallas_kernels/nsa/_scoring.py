"""Eq. 9-10's geometry shared by the compressed branch's scoring kernels (Triton, Mosaic TPU,
Mosaic GPU): selection blocks per compressed tile, the tile's eq. 9 weights, the group sum.

Letters: T query time, R rows of a query tile (positions x heads), P selection blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.nsa._band import Band
from pallas_kernels.nsa.xla import NSAShape, eq9_weight


@dataclasses.dataclass(frozen=True)
class Scoring:
    """Static eq. 9 geometry of one call."""

    shape: NSAShape
    num_blocks: int  # P selection blocks
    heads: int  # G real query heads per kv group (rows past them pad the group)

    @property
    def ratio(self):  # compressed blocks per selection block
        return self.shape.select_block // self.shape.compress_stride

    def check_tile(self, bk):
        """bk compressed blocks per tile must hold whole selection blocks and reach back over the
        l/d - 1 blocks that spill into the next tile."""
        if bk % self.ratio or bk < self.shape.compress_block // self.shape.compress_stride:
            raise ValueError(
                f"compressed_attention: block_k={bk} must be a multiple of select_block / compress_stride "
                f"= {self.ratio} and at least compress_block / compress_stride"
            )
        return bk

    def tiles(self, bk):
        """(selection blocks per compressed tile, compressed tiles covering all P blocks)."""
        per = bk // self.ratio
        return per, -(-self.num_blocks // per)


def eq9_tile_weights(scoring: Scoring, bk, previous):
    """[bk, bk / (l'/d)] weights of a tile's compressed blocks (or, previous=True, of the previous
    tile's) in the tile's selection blocks."""
    per = bk // scoring.ratio
    i = jax.lax.broadcasted_iota(jnp.int32, (bk, per), 0) - (bk if previous else 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (bk, per), 1)
    return eq9_weight(i - scoring.ratio * j, scoring.shape).astype(jnp.float32)


def group_selector(band: Band, heads):
    """[tq, R] 0/1: row r is a real head (of the first ``heads``) of position r // groups."""
    t = jax.lax.broadcasted_iota(jnp.int32, (band.tq, band.rows), 0)
    r = jax.lax.broadcasted_iota(jnp.int32, (band.tq, band.rows), 1)
    return ((r >= t * band.groups) & (r < t * band.groups + heads)).astype(jnp.float32)
