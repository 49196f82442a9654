"""Native Sparse Attention: the plain-JAX reference and the selected-block attention kernels."""

from pallas_kernels.nsa.reference import (
    NSAShape,
    nsa_reference,
    select_attention_reference,
)
from pallas_kernels.nsa.select import select_attention

__all__ = ["NSAShape", "nsa_reference", "select_attention", "select_attention_reference"]
