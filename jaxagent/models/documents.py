"""The layout of a document-attention prompt: `[doc_1, ..., doc_n, final]`.

Document i is segment i + 1 and sees only itself; the final section is segment -1 and sees
every document and itself (the visibility rule of `pallas_kernels.doc_attention`). Positions
follow `DocumentConfig`: with `restart_positions` each document starts at 0, so its KV does not
depend on what precedes it and can be computed once and reused in any prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxagent.models.config import DocumentConfig

FINAL_SEGMENT = -1


def document_layout(doc_lengths: Sequence[int], final_length: int,
                    cfg: DocumentConfig = DocumentConfig()) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions), int32 [sum(doc_lengths) + final_length]."""
    if any(n < 1 for n in doc_lengths):
        raise ValueError(f"documents must not be empty (lengths {list(doc_lengths)})")
    if final_length < 0:
        raise ValueError(f"final_length must be >= 0, got {final_length}")
    segments = [np.full(n, i + 1, np.int32) for i, n in enumerate(doc_lengths)]
    if cfg.restart_positions:
        positions = [np.arange(n, dtype=np.int32) for n in doc_lengths]
        start = (sum(doc_lengths) if cfg.final_positions == "sum"
                 else max(doc_lengths, default=0))
    else:
        positions = [np.arange(n, dtype=np.int32) + s
                     for n, s in zip(doc_lengths, np.cumsum([0, *doc_lengths[:-1]]))]
        start = sum(doc_lengths)
    segments.append(np.full(final_length, FINAL_SEGMENT, np.int32))
    positions.append(np.arange(start, start + final_length, dtype=np.int32))
    return np.concatenate(segments), np.concatenate(positions)


def final_start(doc_lengths: Sequence[int], cfg: DocumentConfig = DocumentConfig()) -> int:
    """The RoPE position of the final section's first token."""
    return int(document_layout(doc_lengths, 1, cfg)[1][-1])
