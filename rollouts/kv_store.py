"""Per-document KV reuse: documents encoded once, alone, and their KV kept for later prompts.

A document prompt is `[doc_1, ..., doc_n, final]` (`jaxagent.models.documents`): each document
attends only to itself, so its keys and values (post-RoPE, every layer) depend only on its
tokens, its positions and the weights. With `DocumentConfig.restart_positions` (the default)
its positions are 0..n-1 wherever it lands, so one encoding serves every prompt it appears in.

An entry is one array [Y, 2, K, n, H] (Y layers, k and v, K kv heads, the document's n tokens,
H head dim) in the cache dtype. Entries live in device memory up to `device_bytes`, least recently
used first out; an evicted entry spills to host memory (numpy, up to `host_bytes`, then
dropped) and is copied back to the device on its next hit. Keys hash the token ids, the first
position, and a model tag that changes with the weights (`Sampler.update_weights` also calls
`clear()`), so a stale KV is never served.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable, Sequence

import jax
import numpy as np

# (tokens, first position) of each document to encode -> one [Y, 2, K, n, H] array each.
EncodeFn = Callable[[list[tuple[list[int], int]]], list[jax.Array]]

_COUNTERS = ("hits", "misses", "device_hits", "host_hits", "tokens_encoded", "tokens_saved",
             "model_calls", "evictions", "dropped")


def document_key(model_tag: str, tokens: Sequence[int], start: int) -> str:
    """A content hash of everything the document's KV depends on."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{model_tag}|{start}|".encode())
    h.update(np.asarray(tokens, np.int32).tobytes())
    return h.hexdigest()


class KVStore:
    """A two-level (device, then host) LRU store of document KVs; see the module docstring."""

    def __init__(self, device_bytes: int = 1 << 30, host_bytes: int = 8 << 30):
        if device_bytes < 0 or host_bytes < 0:
            raise ValueError(f"device_bytes and host_bytes must be >= 0, got {device_bytes}, "
                             f"{host_bytes}")
        self.device_bytes, self.host_bytes = device_bytes, host_bytes
        self._device: collections.OrderedDict[str, jax.Array] = collections.OrderedDict()
        self._host: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.device_used = self.host_used = 0  # bytes
        self.stats = dict.fromkeys(_COUNTERS, 0)

    def __len__(self) -> int:
        return len(self._device) + len(self._host)

    def __contains__(self, key: str) -> bool:
        return key in self._device or key in self._host

    def clear(self) -> None:
        """Forget every entry (new weights); the counters keep running."""
        self._device.clear()
        self._host.clear()
        self.device_used = self.host_used = 0

    # ---- entries ----
    def get(self, key: str) -> jax.Array | None:
        """The entry on the device (copied back from the host if it spilled), or None."""
        if key in self._device:
            self._device.move_to_end(key)
            self.stats["device_hits"] += 1
            return self._device[key]
        if key in self._host:
            self.stats["host_hits"] += 1
            kv = self._host.pop(key)
            self.host_used -= kv.nbytes
            kv = jax.device_put(kv)
            self.put(key, kv)
            return kv
        return None

    def put(self, key: str, kv: jax.Array) -> None:
        if key in self._device:
            self.device_used -= self._device.pop(key).nbytes
        self._device[key] = kv
        self.device_used += kv.nbytes
        # Evict least recently used entries; the newest stays if it alone exceeds the budget
        # (it is about to be read), and goes to the host at the next eviction.
        while self.device_used > self.device_bytes and len(self._device) > 1:
            old_key, old = self._device.popitem(last=False)
            self.device_used -= old.nbytes
            self.stats["evictions"] += 1
            self._spill(old_key, np.asarray(jax.device_get(old)))

    def _spill(self, key: str, kv: np.ndarray) -> None:
        self._host[key] = kv
        self.host_used += kv.nbytes
        while self.host_used > self.host_bytes and self._host:
            self.host_used -= self._host.popitem(last=False)[1].nbytes
            self.stats["dropped"] += 1

    # ---- documents ----
    def lookup(self, model_tag: str, documents: Sequence[tuple[list[int], int]],
               encode: EncodeFn) -> tuple[list[jax.Array], dict]:
        """The KV of each (tokens, first position), encoding only the misses, all in one
        `encode` call. Returns the entries in order and this call's counters."""
        keys = [document_key(model_tag, tokens, start) for tokens, start in documents]
        before = dict(self.stats)
        found: dict[str, jax.Array] = {}
        missing: dict[str, tuple[list[int], int]] = {}  # a document twice in one call: once
        for key, doc in zip(keys, documents):
            if key in found or key in missing:
                continue
            kv = self.get(key)
            if kv is None:
                missing[key] = doc
            else:
                found[key] = kv
        if missing:
            self.stats["model_calls"] += 1
            for key, kv in zip(missing, encode(list(missing.values()))):
                found[key] = kv
                self.put(key, kv)
        encoded = set(missing)
        for key, (tokens, _) in zip(keys, documents):
            miss = key in encoded
            encoded.discard(key)  # later repeats in this call are hits
            self.stats["misses" if miss else "hits"] += 1
            self.stats["tokens_encoded" if miss else "tokens_saved"] += len(tokens)
        delta = {k: self.stats[k] - before[k] for k in _COUNTERS}
        lookups = delta["hits"] + delta["misses"]
        delta["hit_rate"] = delta["hits"] / lookups if lookups else 0.0
        return [found[k] for k in keys], delta
