"""Native Sparse Attention: the plain-JAX reference and the kernels of its three branches
(compressed with block scoring, selected blocks, sliding window)."""

from pallas_kernels.nsa.compressed import compressed_attention
from pallas_kernels.nsa.reference import (
    NSAShape,
    compressed_attention_reference,
    nsa_reference,
    select_attention_reference,
)
from pallas_kernels.nsa.select import select_attention
from pallas_kernels.nsa.window import sliding_window_attention

__all__ = [
    "NSAShape",
    "compressed_attention",
    "compressed_attention_reference",
    "nsa_reference",
    "select_attention",
    "select_attention_reference",
    "sliding_window_attention",
]
