"""Semantic code search: code split into chunks, embedded by a pluggable model, ranked by
cosine similarity.

`Embedding` is anything with `embed(texts) -> [n, d]` unit rows. `NgramEmbedding` is a real,
dependency-free embedding: the hashing trick over identifier words and character 3-grams
(signed feature hashing, as in fastText / Weinberger et al. 2009), L2-normalised. A neural
model (e.g. MiniLM) plugs in through the same protocol.
"""

from __future__ import annotations

import ast
import re
import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

_WORD = re.compile(r"[A-Za-z][a-z]*|[0-9]+")
_WINDOW_LINES = 40  # chunk size for non-Python files


class Embedding(Protocol):
    def embed(self, texts: list[str]) -> np.ndarray: ...  # [n, d], unit-norm rows


@dataclass(frozen=True)
class NgramEmbedding:
    """Signed hashed bag of identifier words (camel/snake split, lower-cased) and char n-grams."""

    dim: int = 512
    n: int = 3

    def _features(self, text: str) -> list[str]:
        words = [w.lower() for w in _WORD.findall(text)]
        grams = [w[i : i + self.n] for w in words for i in range(max(1, len(w) - self.n + 1))]
        return [f"w:{w}" for w in words] + [f"g:{g}" for g in grams]

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), np.float32)
        for row, text in enumerate(texts):
            for feature in self._features(text):
                h = zlib.crc32(feature.encode())
                out[row, h % self.dim] += 1.0 if (h >> 31) & 1 else -1.0
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)


@dataclass(frozen=True)
class Chunk:
    path: str
    start: int  # 1-based first line
    end: int  # 1-based last line
    text: str


def chunks(path: str, source: str) -> list[Chunk]:
    """Functions and classes of a Python file (methods on their own); else line windows."""
    lines = source.splitlines()
    if path.endswith(".py"):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            tree = None
        if tree is not None:
            found = [
                Chunk(path, n.lineno, n.end_lineno, "\n".join(lines[n.lineno - 1 : n.end_lineno]))
                for n in ast.walk(tree)
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            ]
            if found:
                return sorted(found, key=lambda c: (c.start, -c.end))
    return [
        Chunk(path, i + 1, min(i + _WINDOW_LINES, len(lines)),
              "\n".join(lines[i : i + _WINDOW_LINES]))
        for i in range(0, len(lines), _WINDOW_LINES)
    ]


def rank(embedding: Embedding, query: str, pool: list[Chunk], k: int) -> list[tuple[float, Chunk]]:
    """The k chunks most similar to `query` (cosine), best first."""
    if not pool:
        return []
    vectors = embedding.embed([query] + [f"{c.path}\n{c.text}" for c in pool])
    scores = vectors[1:] @ vectors[0]
    order = np.argsort(-scores, kind="stable")[:k]
    return [(float(scores[i]), pool[i]) for i in order]
