"""``compressed_attention``: NSA's compressed branch and block importance, the kernel picked
from the backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.nsa.compressed_gpu import compressed_attention_gpu
from pallas_kernels.nsa.compressed_tpu import compressed_attention_tpu
from pallas_kernels.nsa.reference import NSAShape


def compressed_attention(
    q, k_cmp, v_cmp, *, shape: NSAShape, num_select_blocks, scale=None, interpret=False, block_sizes=None
):
    """q[B,T,N,H], k_cmp[B,C,K,H], v_cmp[B,C,K,V] -> (o [B,T,N,V], importance [B,T,K,P]).

    Query t attends to the compressed blocks i with i*d + l - 1 <= t (eq. 7; none: zeros) and
    reports, per selection block j < P = num_select_blocks, its probabilities mapped by eq. 9
    and summed over its GQA group (eq. 10), the input of the top-n (``reference.top_blocks``).
    Differentiable in q, k_cmp, v_cmp through o; the importance takes no gradient. TPU runs the
    Mosaic kernels, anything else the GPU-style ones (``interpret=True`` on CPU); ``block_sizes``
    is that kernel file's BlockSizes (None: its default).
    """
    if q.ndim != 4 or k_cmp.ndim != 4 or v_cmp.ndim != 4:
        raise ValueError(f"compressed_attention: q, k_cmp, v_cmp must be 4-D, got {q.shape}, {k_cmp.shape}, {v_cmp.shape}")
    b, t, n, h = q.shape
    if k_cmp.shape[:3] != v_cmp.shape[:3] or k_cmp.shape[0] != b or k_cmp.shape[-1] != h:
        raise ValueError(f"compressed_attention: k_cmp {k_cmp.shape} and v_cmp {v_cmp.shape} do not match q {q.shape}")
    kh = k_cmp.shape[2]
    if n % kh:
        raise ValueError(f"compressed_attention: Hq={n} is not a multiple of Hkv={kh}")
    if num_select_blocks < 1:
        raise ValueError(f"compressed_attention: num_select_blocks={num_select_blocks} must be positive")
    if k_cmp.shape[1] == 0:  # shorter than one compression block: nothing to attend to
        return jnp.zeros((b, t, n, v_cmp.shape[-1]), q.dtype), jnp.zeros((b, t, kh, num_select_blocks), jnp.float32)
    kernel = compressed_attention_tpu if jax.default_backend() == "tpu" else compressed_attention_gpu
    tiles = {} if block_sizes is None else {"block_sizes": block_sizes}
    return kernel(q, k_cmp, v_cmp, shape=shape, num_select_blocks=num_select_blocks, scale=scale, interpret=interpret, **tiles)
