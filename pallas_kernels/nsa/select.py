"""``select_attention``: NSA's selected-block attention, the kernel picked from the backend."""

from __future__ import annotations

import jax

from pallas_kernels.nsa.select_gpu import select_attention_gpu
from pallas_kernels.nsa.select_tpu import select_attention_tpu


def select_attention(q, k, v, block_idx, *, block_size, causal=True, scale=None, interpret=False):
    """q[B,T,Hq,D], k[B,S,Hkv,D], v[B,S,Hkv,Dv], block_idx[B,T,Hkv,n] int32 -> [B,T,Hq,Dv].

    Query t of head h attends to the keys of the blocks listed for its kv head h // (Hq/Hkv)
    (each listed block once), keys s <= t when causal; -1 marks an unused slot; scale defaults
    to 1/sqrt(D). TPU runs the scalar-prefetch kernels, anything else the GPU-style ones
    (``interpret=True`` on CPU). Differentiable in q, k, v.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or block_idx.ndim != 4:
        raise ValueError(
            f"select_attention: q, k, v, block_idx must be 4-D, got {q.shape}, {k.shape}, "
            f"{v.shape}, {block_idx.shape}"
        )
    b, t, hq, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[-1] != d:
        raise ValueError(f"select_attention: k {k.shape} and v {v.shape} do not match q {q.shape}")
    if hq % k.shape[2]:
        raise ValueError(f"select_attention: Hq={hq} is not a multiple of Hkv={k.shape[2]}")
    if block_idx.shape[:3] != (b, t, k.shape[2]):
        raise ValueError(f"select_attention: block_idx {block_idx.shape} must be [B,T,Hkv,n] = [{b},{t},{k.shape[2]},n]")
    if block_size < 1:
        raise ValueError(f"select_attention: block_size={block_size} must be positive")
    kernel = select_attention_tpu if jax.default_backend() == "tpu" else select_attention_gpu
    return kernel(q, k, v, block_idx.astype("int32"), block_size=block_size, causal=causal, scale=scale, interpret=interpret)
