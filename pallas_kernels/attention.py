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

Backends of dense and document attention (``resolve_backend`` picks one per call):

  xla     ``doc_attention/xla.py``: einsums over a materialised mask; any rows, any platform.
  pallas  the block-sparse doc kernel (``doc_attention/kernel.py``): any rows; GPU, and CPU
          interpreted. Named for the kernel, not "doc", which is already an attention kind.
          Decode steps (one query per row) run its split-K decode kernel (``decode.py``).
  cudnn   cuDNN flash attention (``causal_attention.py``): causal rows, bfloat16/float16, GPU.
  splash  Pallas TPU splash attention (``causal_attention.py``): causal rows; TPU, and CPU
          interpreted.
  auto    per platform and rows. Dense attention: GPU cudnn for causal rows (pallas in
          float32), pallas for segments and cached calls (prefill and decode steps);
          TPU splash for causal rows, else xla (splash on one chip only: jax cannot partition
          a Mosaic kernel over a mesh); CPU xla. Document attention: pallas, xla on TPU.

Rows (``ROWS``), known where the model is called, not from the segment ids' values:
"causal" one sequence per row from slot 0, then padding; "segments" any ids (packed documents,
shared prompts, negative segments); "cached" a call against a KV cache (the sampler's prefill
and decode steps: left-padded prompts at an offset, T != S). cudnn and splash are kernels for
the training passes: for cached rows they run what ``auto`` runs; on "segments" rows they are
an error. NSA picks its branch kernels from the platform and its own options (``nsa/attention.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.causal_attention import cudnn_attention, splash_attention
from pallas_kernels.doc_attention import decode_attention, doc_attention, visible
from pallas_kernels.doc_attention.xla import decode_attention_keys_transposed, xla_attention
from pallas_kernels.nsa import nsa_attention

BACKENDS = ("auto", "xla", "pallas", "cudnn", "splash")
ROWS = ("causal", "segments", "cached")
# The rows each backend runs, and the platforms it runs on (CPU: Pallas interpreted).
_RUNS = {"xla": ROWS, "pallas": ROWS, "cudnn": ("causal",), "splash": ("causal",)}
_PLATFORMS = {"cudnn": ("gpu",), "splash": ("tpu", "cpu")}
_CUDNN_DTYPES = ("bfloat16", "float16")

__all__ = ["BACKENDS", "ROWS", "check_rows", "dense_attention", "document_attention",
           "nsa_attention", "resolve_backend"]


def check_rows(backend: str, rows: str) -> None:
    """Raise unless the option `backend` can run `rows` on some platform (cached rows always:
    the training-pass kernels leave them to auto). Asks JAX nothing, so a config can be
    checked before ``jax.distributed`` starts."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if rows not in ROWS:
        raise ValueError(f"unknown rows {rows!r}; known: {', '.join(ROWS)}")
    if backend != "auto" and rows not in (*_RUNS[backend], "cached"):
        raise ValueError(f"{backend} runs causal rows only (one sequence per row, then padding), "
                         f"not rows with packed or shared-prompt segments (train.share_prompt, "
                         f"train.pack_tokens, sft.data: documents, model.attention: doc); use "
                         f"auto, pallas or xla")


def resolve_backend(kind: str, backend: str = "auto", *, rows: str = "segments",
                    platform: str | None = None, dtype=None, devices: int | None = None) -> str:
    """The backend ("xla", "pallas", "cudnn" or "splash") that attention of `kind` ("dense" or
    "doc") runs on `rows` (one of ``ROWS``) for the option `backend` (one of ``BACKENDS``), on
    `platform` (default: JAX's) in compute `dtype` (default: any the backend takes), under a
    mesh of `devices` (default: the abstract mesh's, if one is set)."""
    if kind not in ("dense", "doc"):
        raise ValueError(f"attention {kind!r} has no backend option")
    check_rows(backend, rows)
    platform = platform or jax.default_backend()
    dtype = None if dtype is None else jnp.dtype(dtype).name
    devices = devices or max(jax.sharding.get_abstract_mesh().size, 1)
    if backend == "auto":
        return _auto(kind, rows, platform, dtype, devices)
    if platform not in _PLATFORMS.get(backend, (platform,)):
        raise ValueError(f"{backend} runs on {' or '.join(_PLATFORMS[backend])}, not {platform}")
    if backend == "cudnn" and dtype not in (None, *_CUDNN_DTYPES):
        raise ValueError(f"cudnn needs model.dtype bfloat16 (cuDNN's flash attention takes "
                         f"{' or '.join(_CUDNN_DTYPES)}), not {dtype}")
    if rows not in _RUNS[backend]:  # cached rows (check_rows): the sampler under a training kernel
        return _auto(kind, rows, platform, dtype, devices)
    if backend == "splash" and platform == "tpu" and devices > 1:
        raise ValueError(f"splash is a Mosaic kernel, which jax cannot partition over a mesh of "
                         f"{devices} devices (it would need a shard_map); use auto or xla")
    return backend


def _auto(kind, rows, platform, dtype, devices):
    if kind == "dense" and rows == "causal":
        if platform == "gpu":
            return "cudnn" if dtype in _CUDNN_DTYPES else "pallas"
        return "splash" if platform == "tpu" and devices == 1 else "xla"
    if platform == "tpu":
        return "xla"  # the doc kernel is written and tested for GPU (and CPU, interpreted)
    if kind == "doc":
        return "pallas"
    # Cached calls run the kernels on a GPU too: XLA's prefill stores [B, K, G, T, S] float32
    # scores (940 MB a layer for 64 prompts of 512 tokens), and on an H200 the split-K decode
    # kernel's step beat XLA's at every batch (0.5B: 1.71 vs 2.33 ms at 64, 1.21 vs 1.30 at 1).
    return "pallas" if platform == "gpu" else "xla"


def dense_attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_slots, kv_slots, backend="auto",
                    rows="segments", keys_transposed=False):
    """q [B, T, N, H], k and v [B, K, S, H] (with `keys_transposed`, k is [B, K, H, S]: the
    sampler's decode-step copy, one query per row, XLA only), segment ids and slots [B, T] and
    [B, S] int32, `rows` (one of ``ROWS``) as the caller laid them out -> [B, T, N, H]."""
    return _attend("dense", backend, rows, q, k, v, keys_transposed, q_segment_ids=q_segment_ids,
                   kv_segment_ids=kv_segment_ids, q_slots=q_slots, kv_slots=kv_slots)


def document_attention(q, k, v, *, q_segment_ids, kv_segment_ids, q_slots, kv_slots, backend="auto",
                       rows="segments", keys_transposed=False):
    """``dense_attention`` for document-level prompts: the block-sparse kernel unless `backend`
    says otherwise."""
    return _attend("doc", backend, rows, q, k, v, keys_transposed, q_segment_ids=q_segment_ids,
                   kv_segment_ids=kv_segment_ids, q_slots=q_slots, kv_slots=kv_slots)


def _attend(kind, backend, rows, q, k, v, keys_transposed, **segments):
    backend = resolve_backend(kind, backend, rows=rows, dtype=q.dtype)
    if keys_transposed:
        if backend != "xla" or q.shape[1] != 1:
            raise ValueError("keys_transposed is for XLA decode steps (one query per row)")
        mask = visible(segments["q_segment_ids"], segments["kv_segment_ids"], segments["q_slots"],
                       segments["kv_slots"])
        return decode_attention_keys_transposed(q, k, v, mask)
    interpret = jax.default_backend() == "cpu"
    if backend == "pallas":  # a decode step (one query per row) on its own kernel
        kernel = decode_attention if q.shape[1] == 1 else doc_attention
        return kernel(q, k, v, **segments, interpret=interpret)
    ids = {name: segments[name] for name in ("q_segment_ids", "kv_segment_ids")}
    if backend == "cudnn":
        return cudnn_attention(q, k, v, **ids)
    if backend == "splash":
        return splash_attention(q, k, v, **ids, interpret=interpret)
    # an uncached call's slots are its token indices (the module docstring): causal bands
    return xla_attention(q, k, v, **segments, slots_are_indices=rows != "cached")
