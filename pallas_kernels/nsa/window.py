"""``sliding_window_attention``: NSA's window branch, the kernel picked from the backend."""

from __future__ import annotations

import jax

from pallas_kernels.nsa.window_gpu import sliding_window_attention_gpu
from pallas_kernels.nsa.window_tpu import sliding_window_attention_tpu


def sliding_window_attention(q, k, v, *, window, scale=None, interpret=False):
    """q[B,T,Hq,D], k[B,S,Hkv,D], v[B,S,Hkv,Dv] -> [B,T,Hq,Dv].

    Query t of head h attends to the keys s of kv head h // (Hq/Hkv) with t - window < s <= t
    (a query past the last key, S < T, sees none and gets zeros); scale defaults to 1/sqrt(D).
    TPU runs the Mosaic kernels, anything else the GPU-style ones (``interpret=True`` on CPU).
    Differentiable in q, k, v.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"sliding_window_attention: q, k, v must be 4-D, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"sliding_window_attention: k {k.shape} and v {v.shape} do not match q {q.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"sliding_window_attention: Hq={q.shape[2]} is not a multiple of Hkv={k.shape[2]}")
    if int(window) != window or window < 1:
        raise ValueError(f"sliding_window_attention: window={window} must be a positive integer")
    kernel = sliding_window_attention_tpu if jax.default_backend() == "tpu" else sliding_window_attention_gpu
    return kernel(q, k, v, window=int(window), scale=scale, interpret=interpret)
