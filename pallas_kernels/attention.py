"""The attention models call: one function per kind (``dense_attention``,
``document_attention``, ``nsa_attention``), each choosing its backend in one place.

Letters: B batch, T query time, S key time, N query heads, K kv heads, G = N // K query heads
per kv head, H head dim.

Dense and document attention take keys and values laid out [B, K, S, H], the KV cache's
layout: a decode step then reads each (batch, kv head) slice contiguously instead of
transposing the whole cache.

Masking is described, not materialised, so that kernels can skip whole blocks: a query may
see a key iff the key's slot is not after the query's slot (causal) and either both carry the
same segment id, or the query's segment is a "sees all" segment (negative id) and the key's is
a document (positive id). Segment id 0 marks padding and empty cache slots. Slots are token
indices in the (packed or cached) sequence, not RoPE positions, which may restart per document.

Negative segments express one row of shared context: documents `1, 2, ...` attend within
themselves only, and each negative segment attends to all documents and to itself, not to the
other negative segments. A GRPO group packed as `[prompt, completion_1, ..., completion_G]`
(prompt id 1, completion i id -i) thus computes the prompt once; a document-level prompt
(documents 1..n, final section -1) lets each document's KV be computed alone.

Backends of dense and document attention: "xla" (``doc_attention/xla.py``) or "pallas" (the
block-sparse kernel, ``doc_attention/kernel.py``; interpreted on CPU); "auto" is XLA for dense
attention and the kernel for document attention. Both honour negative segments. NSA picks its
branch kernels from the platform and its own options (``nsa/attention.py``).
"""

from __future__ import annotations

import jax

from pallas_kernels.doc_attention import doc_attention, visible
from pallas_kernels.doc_attention.xla import decode_attention_keys_transposed, xla_attention
from pallas_kernels.nsa import nsa_attention

BACKENDS = ("auto", "xla", "pallas")

__all__ = ["BACKENDS", "dense_attention", "document_attention", "nsa_attention", "resolve_backend"]


def resolve_backend(kind: str, backend: str = "auto") -> str:
    """The backend ("xla" or "pallas") attention of `kind` ("dense" or "doc") runs for the
    option `backend` (one of ``BACKENDS``)."""
    if kind not in ("dense", "doc"):
        raise ValueError(f"attention {kind!r} has no backend option")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return "pallas" if kind == "doc" else "xla"


def dense_attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_slots, kv_slots, backend="auto",
                    keys_transposed=False):
    """q [B, T, N, H], k and v [B, K, S, H] (with `keys_transposed`, k is [B, K, H, S]: the
    sampler's decode-step copy, one query per row, XLA only), segment ids and slots [B, T] and
    [B, S] int32 -> [B, T, N, H]."""
    return _attend("dense", backend, q, k, v, keys_transposed, q_segment_ids=q_segment_ids,
                   kv_segment_ids=kv_segment_ids, q_slots=q_slots, kv_slots=kv_slots)


def document_attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_slots, kv_slots, backend="auto",
                       keys_transposed=False):
    """``dense_attention`` for document-level prompts: the block-sparse kernel unless `backend`
    says otherwise."""
    return _attend("doc", backend, q, k, v, keys_transposed, q_segment_ids=q_segment_ids,
                   kv_segment_ids=kv_segment_ids, q_slots=q_slots, kv_slots=kv_slots)


def _attend(kind, backend, q, k, v, keys_transposed, **segments):
    backend = resolve_backend(kind, backend)
    if keys_transposed:
        if backend != "xla" or q.shape[1] != 1:
            raise ValueError("keys_transposed is for XLA decode steps (one query per row)")
        mask = visible(segments["q_segment_ids"], segments["kv_segment_ids"], segments["q_slots"],
                       segments["kv_slots"])
        return decode_attention_keys_transposed(q, k, v, mask)
    if backend == "pallas":
        return doc_attention(q, k, v, **segments, interpret=jax.default_backend() == "cpu")
    return xla_attention(q, k, v, **segments)
