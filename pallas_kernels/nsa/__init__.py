"""Native Sparse Attention: the plain-JAX reference, the selected-block and the sliding-window attention kernels."""

from pallas_kernels.nsa.reference import (
    NSAShape,
    nsa_reference,
    select_attention_reference,
)
from pallas_kernels.nsa.select import select_attention
from pallas_kernels.nsa.window import sliding_window_attention

__all__ = ["NSAShape", "nsa_reference", "select_attention", "select_attention_reference", "sliding_window_attention"]
