"""Multi-turn continuation: episodes keep their KV cache rows between turns."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.models.llama import KVCache
from rollouts.sampler.decode import Sampling, _round_up, check_prompts, decode, left_pad, reserve
from rollouts.sampler.programs import _extend, _forget_slots, _pack_slots

if TYPE_CHECKING:
    from rollouts.sampler.sampler import Sampler


def _fresh_cache(config, batch: int, size: int) -> KVCache:
    """An empty cache whose arrays are distinct buffers (`KVCache.empty` shares one zeros array
    between layers and k/v, which cannot be donated)."""
    return jax.tree.map(jnp.copy, KVCache.empty(config, batch, size))


def context_cache_slots(sampler: Sampler, max_new_tokens: int) -> int:
    """Cache slots for one turn after a rebuild of histories as long as the model's context:
    the whole context left-padded to a prompt bucket, then an action, in whole cache buckets.
    (A longer history rebuilds every turn: slower, still right.)"""
    context = _round_up(sampler.config.max_position_embeddings, sampler.prompt_bucket)
    return _round_up(context + max_new_tokens, sampler.cache_bucket)


class Continuation:
    """Many multi-turn episodes on one persistent KV cache, one batch row (slot) each.

        cont = Continuation(sampler, slots=8, max_new_tokens=256, stop_token_ids=tok.stop_ids)
        cont.start(slot, prompt)            # a new episode in a free slot
        actions = cont.turn()               # {slot: (tokens, logprobs, finish_reason)}
        cont.append(slot, observation)      # the environment's reply
        cont.release(slot)                  # the episode ended; the slot can be refilled

    Each turn prefills only the tokens appended since a slot's last turn (its prompt, or the
    unwritten tail of its action plus the new observation) onto the cache, never the whole
    history, then decodes every active slot's action together. All rows share the cache's write
    index, so each turn's chunks are left-padded (segment 0) like prompts; slots a row did not
    use (padding, decode steps after it stopped, a finished episode) are marked empty. That
    padding would pile up with every turn, and each prefill chunk's attention reads the whole
    cache, so before each prefill a dense model's cache is packed: every row's written slots,
    in order, end at the longest row's count (a gather; the keys carry their positions, so
    nothing is recomputed) and the cache is cut to that plus the turn, in whole `cache_bucket`s.
    Past `max_cache_slots` the cache is rebuilt by re-prefilling the live histories (the only
    whole-history prefill): at every such turn for NSA, whose compressed blocks map positions to
    slots and are not packed; for a dense model only once a history outgrows the bound. The
    default bound (`context_cache_slots`) is the smallest a rebuilt cache always fits.
    """

    def __init__(self, sampler: Sampler, slots: int, *, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 stop_token_ids=(), seed: int = 0, max_cache_slots: int | None = None,
                 row_offset: int = 0):
        if slots < 1:
            raise ValueError(f"slots: must be >= 1, got {slots}")
        self.sampling = Sampling.checked(sampler.config.vocab_size, max_new_tokens=max_new_tokens,
                                         temperature=temperature, top_k=top_k, top_p=top_p,
                                         stop_token_ids=stop_token_ids)
        self.sampler, self.slots = sampler, slots
        self.row_offset = row_offset  # slot i samples as row row_offset + i (ThreadedContinuation)
        self.batch = _round_up(slots, sampler.batch_bucket)
        self.max_cache_slots = (context_cache_slots(sampler, max_new_tokens)
                                if max_cache_slots is None else max_cache_slots)
        self.key = jax.random.key(seed)
        self.history: list[list[int] | None] = [None] * self.batch  # None: a free slot
        self.pending: list[list[int]] = [[] for _ in range(self.batch)]
        self.positions = np.zeros(self.batch, np.int32)  # tokens of the episode in the cache
        self.cache = _fresh_cache(sampler.config, self.batch, sampler.cache_bucket)
        self.used = 0  # host copy of cache.index
        self.turns = 0
        self.stats = {"prefill_tokens": 0, "prefill_slots": 0, "decode_row_steps": 0, "rebuilds": 0,
                      "packs": 0}

    # ---- episodes ----
    def start(self, slot: int, prompt) -> None:
        self._check_slot(slot)
        if self.history[slot] is not None:
            raise ValueError(f"slot {self.row_offset + slot} is busy; release() it first")
        prompt = check_prompts([prompt], self.sampler.config.vocab_size)[0]
        self._forget_row(slot)
        self.history[slot], self.pending[slot] = list(prompt), list(prompt)
        self.positions[slot] = 0

    def append(self, slot: int, tokens) -> None:
        self._check_slot(slot)
        if self.history[slot] is None:
            raise ValueError(f"slot {self.row_offset + slot} has no episode; start() one first")
        tokens = [int(t) for t in tokens]
        self.history[slot] += tokens
        self.pending[slot] += tokens

    def release(self, slot: int) -> None:
        self._check_slot(slot)
        self.history[slot], self.pending[slot] = None, []
        self._forget_row(slot)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside [0, {self.slots})")

    def _forget_row(self, slot: int) -> None:
        keep = np.ones((self.batch, self.cache.size), np.int32)
        keep[slot] = 0
        self.cache = _forget_slots(self.cache, jnp.asarray(keep))

    def _pack(self, needed: int) -> None:
        """Drop the padding between each row's written slots (see the class): they end at the
        longest row's count, in a cache with room for `needed` more slots after them."""
        written = np.asarray(jax.device_get(self.cache.segment_ids))[:, :self.used] != 0
        index = int(written.sum(1).max(initial=0))
        size = _round_up(index + needed, self.sampler.cache_bucket)
        if index == self.used and size >= self.cache.size:
            return  # no padding to drop, no slots to free
        source = np.zeros((self.batch, size), np.int32)
        keep = np.zeros((self.batch, size), np.int32)
        for row, slots in enumerate(written):
            slots = np.flatnonzero(slots)
            source[row, index - len(slots):index] = slots
            keep[row, index - len(slots):index] = 1
        self.cache = _pack_slots(self.cache, jnp.asarray(source), jnp.asarray(keep),
                                 jnp.int32(index))
        self.used = index
        self.stats["packs"] += 1

    def _rebuild(self) -> None:
        """A fresh cache: every live history is prefilled again at the next turn."""
        self.cache = _fresh_cache(self.sampler.config, self.batch, self.sampler.cache_bucket)
        self.used = 0
        for i, h in enumerate(self.history):
            self.pending[i] = list(h) if h is not None else []
            self.positions[i] = 0
        self.stats["rebuilds"] += 1

    # ---- a turn ----
    def prefill(self):
        """Write every slot's pending tokens onto the cache; the logits after them [B, V]."""
        s = self.sampler
        lengths = [len(p) for p in self.pending]
        chunk = _round_up(max(max(lengths), 1), s.prompt_bucket)
        if self.cache.slot_of is None and self.used:
            self._pack(chunk + self.sampling.max_new_tokens)
        if self.used + chunk + self.sampling.max_new_tokens > self.max_cache_slots and self.used:
            self._rebuild()
            return self.prefill()
        tokens, segment_ids, positions = left_pad(self.pending, chunk, self.batch, self.positions)
        cache = reserve(self.cache, self.used, chunk, s.config, s.cache_bucket)
        logits, self.cache = s.run(_extend, cache, tokens, segment_ids, positions)
        self.used += chunk
        self.positions += np.asarray(lengths, np.int32)
        self.pending = [[] for _ in range(self.batch)]
        self.stats["prefill_tokens"] += sum(lengths)
        self.stats["prefill_slots"] += chunk * self.batch
        return logits

    def turn(self) -> dict[int, tuple[list[int], np.ndarray, str]]:
        """Sample one action for every active slot: {slot: (tokens, logprobs, reason)}."""
        active = np.array([h is not None for h in self.history])
        if not active.any():
            self.turns += 1  # turn t draws from key (seed, t) in every part of a threaded one
            return {}
        idle = [i for i in np.flatnonzero(active) if not self.pending[i]]
        if idle:
            raise ValueError(f"slot {self.row_offset + idle[0]} has no new tokens since its last "
                             "action; append() the observation first")
        logits = self.prefill()
        key = jax.random.fold_in(self.key, self.turns)
        rows = np.where(active, self.row_offset + np.arange(self.batch), -1).astype(np.int32)
        start = self.used
        state, step, row_steps = decode(self.sampler, self.sampling, key, self.cache, logits,
                                        rows, self.positions, used=start)
        self.stats["decode_row_steps"] += row_steps
        written_all = step - 1  # decode step k wrote the token sampled at step k-1
        self.cache, self.used = state["cache"], start + written_all
        tokens, logprobs, lengths = jax.device_get(
            (state["tokens"], state["logprobs"], state["lengths"]))
        keep = np.ones((self.batch, self.cache.size), np.int32)
        keep[:, start + written_all:] = 0  # beyond the index: nothing yet, keep it empty
        out = {}
        for i in range(self.batch):
            if not active[i]:
                keep[i, start:start + written_all] = 0
                continue
            n = int(lengths[i])
            toks = tokens[i, :n].tolist()
            written = min(n, written_all)
            keep[i, start + written:start + written_all] = 0  # steps after the row stopped
            self.positions[i] += written
            self.history[i] += toks
            self.pending[i] = toks[written:]  # not in the cache yet: prefilled next turn
            out[i] = (toks, logprobs[i, :n], self.sampling.finish_reason(toks))
        self.cache = _forget_slots(self.cache, jnp.asarray(keep))
        self.turns += 1
        return out
