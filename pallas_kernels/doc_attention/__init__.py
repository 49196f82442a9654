"""Document-level attention: a block-sparse flash kernel over segments (see kernel.py), and
its decode step (one query per row against a cache: decode.py)."""

from pallas_kernels.doc_attention.decode import decode_attention

from pallas_kernels.doc_attention.kernel import (
    BlockSizes,
    block_visibility,
    doc_attention,
    doc_attention_reference,
    visible,
)

__all__ = ["BlockSizes", "block_visibility", "decode_attention", "doc_attention",
           "doc_attention_reference", "visible"]
