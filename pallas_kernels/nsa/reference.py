"""Native Sparse Attention (DeepSeek, arXiv 2502.11089) read off the paper: the plain oracle
the tests hold the kernels and the production XLA path (``xla.py``) to. Masked, O(T * S), no
chunking, no strided or gathered forms; eq. 9 as the literal double sum. Dtype-generic (float64
under ``jax.enable_x64``). Not used outside tests.

Letters as in ``xla.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.nsa.xla import (  # noqa: F401  (the building blocks, for the tests too)
    NSAShape,
    attend,
    compress_blocks,
    compressed_mask,
    compressed_probs,
    gates,
    group_scores,
    select_blocks,
    top_blocks,
)


def selected_mask(block_idx, block_size, s_len, causal):
    """[B,T,K,J] block indices -> [B,T,K,S] key mask; -1 (or out of range) marks an unused slot."""
    t_len = block_idx.shape[1]
    key_block = jnp.arange(s_len) // block_size
    hit = block_idx[..., None] == key_block  # [B,T,K,J,S]; -1 never matches
    mask = jnp.any(hit, axis=3)
    if causal:
        mask &= (jnp.arange(s_len)[None, :] <= jnp.arange(t_len)[:, None])[None, :, None, :]
    return mask


def select_attention_reference(q, k, v, block_idx, *, block_size, causal=True, scale=None):
    """Exact semantics of ``select_attention``: query t of head n attends to the keys of the
    blocks listed in block_idx[b, t, n // G] (each listed block once; -1 slots unused), keys
    s <= t when causal. Returns [B,T,N,V]; rows with no visible key are zero."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = selected_mask(block_idx, block_size, k.shape[1], causal)
    return attend(q, k, v, mask, scale)


def sliding_window_mask(t_len, s_len, window):
    """[1,T,1,S]: key s visible to query t iff t - window < s <= t."""
    t = jnp.arange(t_len)[:, None]
    s = jnp.arange(s_len)[None, :]
    return ((s <= t) & (s > t - window))[None, :, None, :]


def sliding_window_reference(q, k, v, *, window, scale=None):
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return attend(q, k, v, sliding_window_mask(q.shape[1], k.shape[1], window), scale)


def init_compress_params(key, shape: NSAShape, head_dim, hidden=None, dtype=jnp.float32):
    """phi: intra-block position encoding pos[L,H], then MLP  [L*H] -> F -> H  (GELU)."""
    l = shape.compress_block
    f = hidden or head_dim
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "pos": 0.02 * jax.random.normal(k1, (l, head_dim), dtype),
        "w1": jax.random.normal(k2, (l, head_dim, f), dtype) / math.sqrt(l * head_dim),
        "w2": jax.random.normal(k3, (f, head_dim), dtype) / math.sqrt(f),
    }


def init_nsa_params(key, shape: NSAShape, num_heads, head_dim, value_dim=None, dtype=jnp.float32):
    kk, kv, kg = jax.random.split(key, 3)
    return {
        "compress_k": init_compress_params(kk, shape, head_dim, dtype=dtype),
        "compress_v": init_compress_params(kv, shape, value_dim or head_dim, dtype=dtype),
        "gate": 0.02 * jax.random.normal(kg, (num_heads, head_dim, 3), dtype),
    }


def selection_scores_reference(p_cmp, num_select_blocks, shape: NSAShape):
    """Eq. 9 as written: p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[(l'/d) j + m - n], terms out
    of range left out; p_cmp[..., C] -> [..., P] (P = num_select_blocks)."""
    d = shape.compress_stride
    ratio, span = shape.select_block // d, shape.compress_block // d
    c = p_cmp.shape[-1]
    terms = np.zeros((c, num_select_blocks))  # how often p_cmp[i] enters p_slc[j]
    for j in range(num_select_blocks):
        for m in range(ratio):
            for n in range(span):
                if 0 <= ratio * j + m - n < c:
                    terms[ratio * j + m - n, j] += 1
    return jnp.einsum("...c,cp->...p", p_cmp, jnp.asarray(terms, p_cmp.dtype))


def nsa_block_idx(q, k_cmp, shape: NSAShape, s_len, scale, offset=0):
    """The selection of each query: compressed probabilities -> eq. 9 -> group sum -> top-n."""
    mask = compressed_mask(q.shape[1], k_cmp.shape[1], shape, offset)
    p_cmp = compressed_probs(q, k_cmp, mask, scale)
    p_slc = selection_scores_reference(p_cmp, -(-s_len // shape.select_block), shape)
    return select_blocks(p_slc, k_cmp.shape[2], shape, offset)


def compressed_attention_reference(q, k_cmp, v_cmp, *, shape: NSAShape, num_select_blocks, scale=None, offset=0):
    """The compressed branch and its by-product: q[B,T,N,H] at positions offset + t,
    k_cmp[B,C,K,H], v_cmp[B,C,K,V] -> (o_cmp [B,T,N,V] (eq. 7), block importance [B,T,K,P]
    (eqs. 9-10, no gradient))."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = compressed_mask(q.shape[1], k_cmp.shape[1], shape, offset)
    p = compressed_probs(jax.lax.stop_gradient(q), jax.lax.stop_gradient(k_cmp), mask, scale)
    score = group_scores(selection_scores_reference(p, num_select_blocks, shape), k_cmp.shape[2])
    return attend(q, k_cmp, v_cmp, mask, scale), score


def nsa_reference(q, k, v, params, shape: NSAShape, scale=None, select_fn=None):
    """The full NSA layer on a causal sequence: q[B,T,N,H], k[B,T,K,H], v[B,T,K,V] -> [B,T,N,V].

    ``select_fn`` replaces the selected-branch attention (same signature as
    select_attention_reference), so the kernels plug into the same layer.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s_len = k.shape[1]
    k_cmp = compress_blocks(k, params["compress_k"], shape)
    v_cmp = compress_blocks(v, params["compress_v"], shape)
    cmp_mask = compressed_mask(q.shape[1], k_cmp.shape[1], shape)
    o_cmp = attend(q, k_cmp, v_cmp, cmp_mask, scale)
    block_idx = nsa_block_idx(jax.lax.stop_gradient(q), jax.lax.stop_gradient(k_cmp), shape, s_len, scale)
    select_fn = select_fn or select_attention_reference
    o_slc = select_fn(q, k, v, block_idx, block_size=shape.select_block, causal=True, scale=scale)
    o_win = sliding_window_reference(q, k, v, window=shape.window, scale=scale)
    g = gates(q, params["gate"])
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win