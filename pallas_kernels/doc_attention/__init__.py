"""Document-level attention: a block-sparse flash kernel over segments (see kernel.py)."""

from pallas_kernels.doc_attention.kernel import (
    BlockSizes,
    block_visibility,
    doc_attention,
    doc_attention_reference,
    visible,
)

__all__ = ["BlockSizes", "block_visibility", "doc_attention", "doc_attention_reference",
           "visible"]
