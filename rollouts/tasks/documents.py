"""A synthetic retrieval family for document attention: several short documents of
`key=value` lines, then a final section asking for one key's value.

With document attention (`model.attention: doc`) each document is encoded alone and only the
final section reads across them, so answering trains exactly the cross-document path: the
family exists to fine-tune that mechanism (configs/doc_tiny.yaml), not to be a benchmark.
"""

from __future__ import annotations

import string
from typing import NamedTuple

import numpy as np


class DocumentExample(NamedTuple):
    documents: list[str]  # each attends only to itself
    question: str  # the final section's prompt: "<key>="
    answer: str  # the value, then a newline: what the loss is on


def lookup_examples(num: int, *, num_documents: int = 4, entries: int = 3,
                    seed: int = 0) -> list[DocumentExample]:
    """`num` examples, each with `num_documents` documents of `entries` distinct 2-letter keys
    (distinct across the example) mapped to 3-digit values; the question names one key."""
    if num_documents < 1 or entries < 1:
        raise ValueError(f"num_documents and entries must be >= 1, got {num_documents}, {entries}")
    letters = np.array(list(string.ascii_lowercase))
    keys_needed = num_documents * entries
    if keys_needed > 26 * 26:
        raise ValueError(f"num_documents * entries = {keys_needed} exceeds the 676 2-letter keys")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        codes = rng.choice(26 * 26, keys_needed, replace=False)
        keys = [letters[c // 26] + letters[c % 26] for c in codes]
        values = [f"{v:03d}" for v in rng.integers(0, 1000, keys_needed)]
        docs = ["".join(f"{keys[d * entries + e]}={values[d * entries + e]}\n"
                        for e in range(entries)) for d in range(num_documents)]
        asked = int(rng.integers(keys_needed))
        out.append(DocumentExample(docs, f"{keys[asked]}=", values[asked] + "\n"))
    return out
