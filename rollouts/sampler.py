"""JAX-native sampler: jitted prefill and decode over a preallocated, growing KV cache.

Letters: B batch rows, P prompts, G samples per prompt, L prompt length, S cache slots,
N generated-token buffer, V vocab.

How a call runs:
1. Prompts are left-padded to a bucketed length L (segment id 0 marks padding), so every row
   writes its next token to the same cache slot and one `dynamic_update_slice` serves all.
2. Group prefix sharing: each distinct prompt is prefilled once; its cache rows and last
   logits are repeated to its G decoding rows ("prefill once, many decoders").
3. Decoding runs in jitted segments of `segment_steps` tokens (a `lax.while_loop` that also
   stops when every row is done). Between segments the host grows the cache by
   `cache_bucket` slots only when needed, so attention cost follows the tokens actually
   in the cache, not a worst-case capacity, and compacts the batch to half its size once
   half the rows have finished, so finished rows stop costing compute.
All shapes are bucketed (batch, prompt length, cache size, output buffer), so repeated calls
reuse compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxagent.models.llama import KVCache

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


@dataclasses.dataclass(frozen=True)
class _SamplingMode:
    """Static sampling switches: each combination is one compiled program."""

    greedy: bool
    top_k: int | None
    top_p: bool


def sample_tokens(logits, keys, temperature, top_p, mode: _SamplingMode):
    """Sample one token per row; return it and its log-probability under the distribution
    actually sampled (tempered, then truncated by top-k / top-p when they are set).

    Greedy decoding reports the untempered log-softmax of the argmax token.
    """
    logits = logits.astype(jnp.float32)
    if mode.greedy:
        tokens = jnp.argmax(logits, axis=-1)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    scaled = logits / temperature
    neg_inf = jnp.finfo(jnp.float32).min
    if mode.top_k is not None:
        kth = jax.lax.top_k(scaled, mode.top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, neg_inf, scaled)
    if mode.top_p:
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_desc, keep - 1, axis=-1)
        scaled = jnp.where(scaled < threshold, neg_inf, scaled)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    tokens = jax.vmap(jax.random.categorical)(keys, scaled)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def _row_keys(base_key, step, rows):
    """One key per (step, original row): a row's randomness does not depend on its batch slot."""
    step_key = jax.random.fold_in(base_key, step)
    return jax.vmap(jax.random.fold_in, (None, 0))(step_key, rows)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prefill(graphdef, params, tokens, segment_ids, positions):
    model = nnx.merge(graphdef, params)
    cache = KVCache.empty(model.config, tokens.shape[0], tokens.shape[1])
    logits, cache = model(tokens, positions, segment_ids, cache, last_only=True)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("mode",))
def _first_tokens(logits, rows, key, temperature, top_p, stop_ids, mode):
    tokens, logprobs = sample_tokens(logits, _row_keys(key, 0, rows), temperature, top_p, mode)
    done = (rows < 0) | jnp.isin(tokens, stop_ids)
    return tokens, logprobs, done


@functools.partial(jax.jit, static_argnames=("graphdef", "mode"), donate_argnames=("state",))
def _decode_segment(graphdef, params, state, limit, max_new, key, temperature, top_p, stop_ids,
                    mode):
    """Decode until `limit` tokens per row are generated or every row is done."""
    model = nnx.merge(graphdef, params)

    def cond(s):
        return (s["step"] < limit) & ~jnp.all(s["done"])

    def body(s):
        step = s["step"]
        last = jax.lax.dynamic_index_in_dim(s["tokens"], step - 1, axis=1, keepdims=True)
        ones = jnp.ones_like(last, dtype=jnp.int32)
        logits, cache = model(last, s["positions"][:, None], ones, s["cache"])
        keys = _row_keys(key, step, s["rows"])
        token, logprob = sample_tokens(logits[:, 0], keys, temperature, top_p, mode)
        live = ~s["done"]
        token = jnp.where(live, token, 0)
        done = s["done"] | (live & (jnp.isin(token, stop_ids) | (step + 1 >= max_new)))
        return dict(
            s,
            cache=cache,
            tokens=jax.lax.dynamic_update_index_in_dim(s["tokens"], token, step, axis=1),
            logprobs=jax.lax.dynamic_update_index_in_dim(
                s["logprobs"], jnp.where(live, logprob, 0.0), step, axis=1),
            lengths=s["lengths"] + live,
            positions=s["positions"] + 1,
            done=done,
            step=step + 1,
        )

    return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnames=("extra",))
def _grow_cache(cache: KVCache, extra: int) -> KVCache:
    pad = [(0, 0), (0, 0), (0, extra), (0, 0)]
    return KVCache(
        k=[jnp.pad(x, pad) for x in cache.k],
        v=[jnp.pad(x, pad) for x in cache.v],
        segment_ids=jnp.pad(cache.segment_ids, [(0, 0), (0, extra)]),
        index=cache.index,
    )


def _take_rows(tree, index):
    """Gather batch rows of every [B, ...] array in a pytree (scalars pass through)."""
    return jax.tree.map(lambda x: x[index] if x.ndim else x, tree)


_take_rows_jit = jax.jit(_take_rows)


class Sampler:
    """Generates completions for token prompts with a Flax NNX decoder.

    `update_weights(model)` swaps in new parameters without recompiling (same shapes).
    """

    def __init__(self, model, tokenizer=None, *, prompt_bucket: int = 64, cache_bucket: int = 128,
                 batch_bucket: int = 8, segment_steps: int = 32, prefix_sharing: bool = True,
                 compact: bool = True):
        self.graphdef, self.params = nnx.split(model)
        self.config = model.config
        self.tokenizer = tokenizer
        self.prompt_bucket = prompt_bucket
        self.cache_bucket = cache_bucket
        self.batch_bucket = batch_bucket
        self.segment_steps = segment_steps
        self.prefix_sharing = prefix_sharing
        self.compact = compact

    def update_weights(self, model_or_params) -> None:
        params = model_or_params
        if isinstance(model_or_params, nnx.Module):
            params = nnx.state(model_or_params)
        self.params = params

    # -----------------------------------------------------------------------------------------

    def _check_prompts(self, prompts) -> list[list[int]]:
        if not prompts:
            raise ValueError("prompts: empty list")
        vocab = self.config.vocab_size
        out = []
        for i, prompt in enumerate(prompts):
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError(f"prompts[{i}]: empty prompt (need at least one token)")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{i}]: token id {bad[0]} outside vocab [0, {vocab})")
            out.append(ids)
        return out

    def _pad_prompts(self, prompts: list[list[int]]):
        """Left-pad to a bucketed length and a bucketed batch; padding rows have row id -1."""
        length = _round_up(max(map(len, prompts)), self.prompt_bucket)
        # Powers of two below one batch bucket, so one shared prompt prefills one row.
        n = len(prompts)
        batch = 1 << (n - 1).bit_length() if n < self.batch_bucket else _round_up(n, self.batch_bucket)
        tokens = np.zeros((batch, length), np.int32)
        segment_ids = np.zeros((batch, length), np.int32)
        positions = np.zeros((batch, length), np.int32)
        for i, prompt in enumerate(prompts):
            n = len(prompt)
            tokens[i, length - n:] = prompt
            segment_ids[i, length - n:] = 1
            positions[i, length - n:] = np.arange(n)
        return tokens, segment_ids, positions

    def generate(self, prompts: list[list[int]], *, num_samples: int = 1, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 stop_token_ids=(), seed: int = 0) -> SampleOutput:
        prompts = self._check_prompts(prompts)
        if num_samples < 1:
            raise ValueError(f"num_samples: must be >= 1, got {num_samples}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {temperature}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
        if top_k is not None and not 0 < top_k <= self.config.vocab_size:
            raise ValueError(f"top_k: must be in [1, vocab_size], got {top_k}")
        stop_token_ids = tuple(int(t) for t in stop_token_ids)
        if len(stop_token_ids) > _MAX_STOP_IDS:
            raise ValueError(f"stop_token_ids: at most {_MAX_STOP_IDS}, got {len(stop_token_ids)}")
        mode = _SamplingMode(greedy=temperature == 0, top_k=top_k, top_p=top_p is not None)
        stop_ids = jnp.asarray(stop_token_ids + (-1,) * (_MAX_STOP_IDS - len(stop_token_ids)),
                               jnp.int32)
        temperature_ = jnp.float32(temperature or 1.0)
        top_p_ = jnp.float32(top_p or 1.0)
        key = jax.random.key(seed)
        g = num_samples
        num_rows = len(prompts) * g
        t0 = time.perf_counter()

        # Prefill: each distinct prompt once (prefix sharing), or every row (for comparison).
        to_prefill = prompts if self.prefix_sharing else [p for p in prompts for _ in range(g)]
        tokens, segment_ids, positions = self._pad_prompts(to_prefill)
        logits, cache = _prefill(self.graphdef, self.params, tokens, segment_ids, positions)
        repeat = g if self.prefix_sharing else 1
        batch = _round_up(num_rows, self.batch_bucket)
        # Decoding row r reads prefill row r // repeat; rows past num_rows are padding.
        source = np.minimum(np.arange(batch) // repeat, len(to_prefill) - 1)
        cache, logits = _take_rows_jit((cache, logits), source)
        rows = np.where(np.arange(batch) < num_rows, np.arange(batch), -1).astype(np.int32)
        jax.block_until_ready(logits)  # so prefill_seconds times the prefill, not its dispatch
        prefill_s = time.perf_counter() - t0

        max_new = _round_up(max_new_tokens, 64)
        first, first_lp, done = _first_tokens(logits, rows, key, temperature_, top_p_, stop_ids,
                                              mode=mode)
        lengths = np.array([len(prompts[min(r, num_rows - 1) // g]) for r in range(batch)])
        state = dict(
            cache=cache,
            tokens=jnp.zeros((batch, max_new), jnp.int32).at[:, 0].set(first),
            logprobs=jnp.zeros((batch, max_new), jnp.float32).at[:, 0].set(first_lp),
            lengths=jnp.asarray(rows >= 0, jnp.int32),
            positions=jnp.asarray(lengths, jnp.int32),
            done=done | (max_new_tokens == 1),
            rows=jnp.asarray(rows),
            step=jnp.int32(1),
        )
        results: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        step, used_slots = 1, tokens.shape[1]
        decode_rows = 0
        while step < max_new_tokens:
            if self.compact:
                state = self._maybe_compact(state, results)
            if state is None:
                break
            n = min(self.segment_steps, max_new_tokens - step)
            free = state["cache"].size - used_slots
            if free < n:
                state["cache"] = _grow_cache(state["cache"],
                                             extra=_round_up(n - free, self.cache_bucket))
            state = _decode_segment(self.graphdef, self.params, state, jnp.int32(step + n),
                                    jnp.int32(max_new_tokens), key, temperature_, top_p_,
                                    stop_ids, mode=mode)
            new_step = int(state["step"])
            decode_rows += (new_step - step) * state["done"].shape[0]
            used_slots += new_step - step
            step = new_step
            if bool(jnp.all(state["done"])):
                break
        if state is not None:
            self._collect(state, np.ones(state["done"].shape[0], bool), results)

        out_tokens, out_logprobs, reasons = [], [], []
        stop_set = set(stop_token_ids)
        for r in range(num_rows):
            toks, lps = results[r]
            out_tokens.append(toks.tolist())
            out_logprobs.append(lps)
            reasons.append("stop" if toks.size and int(toks[-1]) in stop_set else "length")
        stats = dict(prefill_rows=int(tokens.shape[0]), prefill_tokens=int(segment_ids.sum()),
                     prefill_seconds=prefill_s, decode_row_steps=decode_rows,
                     generated_tokens=sum(map(len, out_tokens)),
                     seconds=time.perf_counter() - t0)
        return SampleOutput(out_tokens, out_logprobs, reasons, stats, self.tokenizer)

    # -----------------------------------------------------------------------------------------

    @staticmethod
    def _collect(state, which: np.ndarray, results: dict) -> None:
        """Copy the outputs of rows `which` (a batch mask) to the host `results`."""
        rows, lengths, tokens, logprobs = jax.device_get(
            (state["rows"], state["lengths"], state["tokens"], state["logprobs"]))
        for i in np.flatnonzero(which):
            if rows[i] >= 0 and rows[i] not in results:
                n = lengths[i]
                results[int(rows[i])] = (tokens[i, :n], logprobs[i, :n])

    def _maybe_compact(self, state, results):
        """Halve the batch once half its rows are done; return None when all are done."""
        done = np.asarray(state["done"])
        batch = done.shape[0]
        live = np.flatnonzero(~done)
        if live.size == 0:
            self._collect(state, done, results)
            return None
        target = _round_up(max(batch // 2, 1), self.batch_bucket)
        if live.size > target or target >= batch:
            return state
        self._collect(state, done, results)
        # Fill the smaller batch with live rows, then finished rows as padding (marked dead).
        index = np.concatenate([live, np.flatnonzero(done)])[:target]
        state = _take_rows_jit(state, index)
        pad = np.arange(target) >= live.size
        state["rows"] = jnp.where(pad, -1, state["rows"])
        state["done"] = state["done"] | pad
        return state
