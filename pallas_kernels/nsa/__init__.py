"""Native Sparse Attention: the plain-JAX reference and the selected-block attention kernels."""

from pallas_kernels.nsa.reference import (
    NSAShape,
    nsa_reference,
    select_attention_reference,
)

__all__ = ["NSAShape", "nsa_reference", "select_attention_reference"]
