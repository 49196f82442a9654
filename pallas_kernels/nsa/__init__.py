"""Native Sparse Attention: ``nsa_attention`` (the layer; the one place its kernels are picked,
``attention.py``), the kernels of its three branches (compressed with block scoring, selected
blocks, sliding window), the production XLA path with decoding over a KV cache (``xla.py``),
and the plain oracle the tests use (``reference.py``)."""

from pallas_kernels.nsa.attention import (
    compressed_attention,
    nsa_attention,
    select_attention,
    sliding_window_attention,
)
from pallas_kernels.nsa.xla import NSAShape, append_compressed, cache_keys, nsa_decode_step, nsa_forward

__all__ = [
    "NSAShape",
    "append_compressed",
    "cache_keys",
    "compressed_attention",
    "nsa_attention",
    "nsa_decode_step",
    "nsa_forward",
    "select_attention",
    "sliding_window_attention",
]
