"""What `Sampler` and `Continuation` share: checked inputs and sampling settings, left-padded
chunks, and the decoding of a batch (first tokens, then jitted segments on a growing cache)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jaxagent.models.llama import KVCache
from rollouts.sampler.programs import _decode_segment, _first_tokens, _grow_cache
from rollouts.sampler.sampling import _SamplingMode

if TYPE_CHECKING:
    from rollouts.sampler.sampler import Sampler

_MAX_STOP_IDS = 8


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass
class SampleOutput:
    tokens: list[list[int]]  # generated ids per row, prompt excluded, stop token included
    logprobs: list[np.ndarray]  # the sampling policy's log-probability of each token
    finish_reasons: list[str]  # "stop" (a stop id was sampled) or "length"
    stats: dict  # prefill/decode token counts and seconds
    tokenizer: object = None

    @property
    def texts(self) -> list[str]:
        if self.tokenizer is None:
            raise ValueError("Sampler was built without a tokenizer; decode `.tokens` yourself")
        return [self.tokenizer.decode(t) for t in self.tokens]


def check_tokens(tokens, vocab: int, where: str, empty: str) -> list[int]:
    """`tokens` as ints; a ValueError naming `where` if there are none (`empty` says what is
    missing) or one is outside the vocab."""
    ids = [int(t) for t in tokens]
    if not ids:
        raise ValueError(f"{where}: {empty}")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{where}: token id {bad[0]} outside vocab [0, {vocab})")
    return ids


def check_prompts(prompts, vocab: int) -> list[list[int]]:
    if not prompts:
        raise ValueError("prompts: empty list")
    return [check_tokens(p, vocab, f"prompts[{i}]", "empty prompt (need at least one token)")
            for i, p in enumerate(prompts)]


@dataclasses.dataclass(eq=False)
class Sampling:
    """One call's checked sampling settings, as the programs take them."""

    max_new_tokens: int
    mode: _SamplingMode
    temperature: jax.Array
    top_p: jax.Array
    stop_ids: jax.Array  # [_MAX_STOP_IDS], padded with -1 (a fixed shape: one program)
    stop_set: set[int]

    @classmethod
    def checked(cls, vocab: int, *, max_new_tokens: int, temperature: float, top_k: int | None,
                top_p: float | None, stop_token_ids) -> Sampling:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
        if top_k is not None and not 0 < top_k <= vocab:
            raise ValueError(f"top_k: must be in [1, vocab_size], got {top_k}")
        stop_token_ids = tuple(int(t) for t in stop_token_ids)
        if len(stop_token_ids) > _MAX_STOP_IDS:
            raise ValueError(f"stop_token_ids: at most {_MAX_STOP_IDS}, got {len(stop_token_ids)}")
        return cls(
            max_new_tokens=max_new_tokens,
            mode=_SamplingMode(greedy=temperature == 0, top_k=top_k, top_p=top_p is not None),
            temperature=jnp.float32(temperature or 1.0),
            top_p=jnp.float32(top_p or 1.0),
            stop_ids=jnp.asarray(stop_token_ids + (-1,) * (_MAX_STOP_IDS - len(stop_token_ids)),
                                 jnp.int32),
            stop_set=set(stop_token_ids))

    def finish_reason(self, tokens) -> str:
        return "stop" if len(tokens) and int(tokens[-1]) in self.stop_set else "length"


def left_pad(seqs, length: int, batch: int, starts=None):
    """tokens, segment_ids, positions [batch, length]: each sequence right-aligned (segment 0
    marks padding, so all rows write their next token to the same cache slot); row i's
    positions start at `starts[i]` (default 0). Rows past `seqs` are all padding."""
    tokens = np.zeros((batch, length), np.int32)
    segment_ids = np.zeros((batch, length), np.int32)
    positions = np.zeros((batch, length), np.int32)
    for i, seq in enumerate(seqs):
        n = len(seq)
        tokens[i, length - n:] = seq
        segment_ids[i, length - n:] = 1
        positions[i, length - n:] = np.arange(n) + (0 if starts is None else starts[i])
    return tokens, segment_ids, positions


def reserve(cache: KVCache, used: int, needed: int, config, bucket: int) -> KVCache:
    """`cache` with at least `needed` free slots after its `used` ones, grown by whole buckets."""
    free = cache.size - used
    if free < needed:
        cache = _grow_cache(cache, cfg=config, extra=_round_up(needed - free, bucket))
    return cache


def decode(sampler: Sampler, sampling: Sampling, key, cache: KVCache, logits, rows: np.ndarray,
           positions, *, used: int, before: Callable[[dict], dict] | None = None,
           after: Callable[[dict], None] | None = None) -> tuple[dict, int, int]:
    """Sample each row's first token from `logits` [B, V], then decode onto `cache` (`used`
    slots written) in segments of `sampler.segment_steps` until every row is done. Row r
    samples with the keys of row `rows[r]` (-1: padding, done from the start); `positions`
    [B] are the rows' next positions.

    Between segments the host grows the cache only when needed; `before(state)` may replace
    the state before each segment (compaction), `after(state)` sees it after each segment
    that leaves rows live (early reports). Returns the state, the steps taken (the first
    token's included) and the row-steps decoded."""
    first, first_lp, done = _first_tokens(logits, rows, key, sampling.temperature,
                                          sampling.top_p, sampling.stop_ids, mode=sampling.mode)
    batch, max_new = rows.shape[0], _round_up(sampling.max_new_tokens, 64)  # a bucketed buffer
    state = {
        "cache": cache,
        "tokens": jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(first),
        "logprobs": jnp.zeros((batch, max_new), jnp.float32).at[:, 0].set(first_lp),
        "lengths": jnp.asarray(rows >= 0, jnp.int32),
        "positions": jnp.asarray(positions, jnp.int32),
        "done": done | (sampling.max_new_tokens == 1),
        "rows": jnp.asarray(rows),
        "step": jnp.int32(1),
    }
    step, row_steps = 1, 0
    live = _live(state, step, sampling)
    while live:
        if before is not None:
            state = before(state)
        n = min(sampler.segment_steps, sampling.max_new_tokens - step)
        # decode step k writes the token sampled at step k - 1 at the cache's next slot
        state["cache"] = reserve(state["cache"], used + step - 1, n, sampler.config,
                                 sampler.cache_bucket)
        state = sampler.run(_decode_segment, state, jnp.int32(step + n),
                            jnp.int32(sampling.max_new_tokens), key, sampling.temperature,
                            sampling.top_p, sampling.stop_ids, mode=sampling.mode)
        new_step = int(state["step"])
        row_steps += (new_step - step) * state["done"].shape[0]
        step = new_step
        live = _live(state, step, sampling)
        if live and after is not None:
            after(state)
    return state, step, row_steps


def _live(state, step: int, sampling: Sampling) -> bool:
    return step < sampling.max_new_tokens and not bool(jnp.all(state["done"]))
