"""JAX-native sampler: jitted prefill and decode over a preallocated, growing KV cache.

Letters: B batch rows, P prompts, G samples per prompt, L prompt length, S cache slots,
N generated-token buffer, V vocab; for document KVs (`rollouts/kv_store.py`) also Y layers,
K kv heads, H head dim, W document slots per row.

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
4. On a CPU backend a call's prompts are split over host threads (`host_threads`, default
   the cores), each running steps 1-3 on its rows: XLA:CPU runs a small decode step's ops
   on one core. Row ids stay global, so outputs equal one thread's. Multi-turn episodes
   (`continuation(...)`) split their slots the same way (`ThreadedContinuation`).
All shapes are bucketed (batch, prompt length, cache size, output buffer), so repeated calls
reuse compiled programs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxagent.models.documents import document_layout
from jaxagent.models.llama import KVCache, backend_name
from rollouts.kv_store import KVStore

_MAX_STOP_IDS = 8
_WEIGHTS_IDS = itertools.count()  # a fresh id per weights a sampler holds (KV store keys)


def _usable_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS has one: Linux)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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
        tokens = _argmax(logits)
        return tokens, _log_softmax_at(logits, tokens)
    scaled = sampling_logits(logits, temperature, mode.top_k, top_p if mode.top_p else None)
    tokens = _inverse_cdf_sample(scaled, keys)
    return tokens, _log_softmax_at(scaled, tokens)


def sampling_logits(logits, temperature, top_k: int | None = None, top_p=None):
    """The logits of the distribution `sample_tokens` draws from, [..., V]: tempered, then
    truncated by top-k and top-p (None: off), the cut tokens at float32's minimum. The
    trainer scores rollouts with the same function, so on-policy ratios are exactly 1."""
    scaled = logits.astype(jnp.float32) / temperature
    neg_inf = jnp.finfo(jnp.float32).min
    if top_k is not None:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, neg_inf, scaled)
    if top_p is not None:
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_desc, keep - 1, axis=-1)
        scaled = jnp.where(scaled < threshold, neg_inf, scaled)
    return scaled


def _inverse_cdf_sample(scaled, keys):
    """One token per row from softmax(scaled), with one uniform u per row: the first token
    whose running mass exceeds u * total. The Gumbel-max trick (jax.random.categorical) draws
    V random numbers per row instead; on XLA:CPU those took longer than the model's decode step.

    Tokens of zero weight (masked by top-k / top-p) are never picked, even where the cumsum's
    rounding is not monotone; if u * total lands past every valid token's running mass (a
    rounding case), the row falls back to its most likely token.
    """
    vocab = scaled.shape[-1]
    weights = jnp.exp(scaled - scaled.max(axis=-1, keepdims=True))
    mass = jnp.cumsum(weights, axis=-1)
    total = mass[:, -1:]
    u = jax.vmap(lambda key: jax.random.uniform(key, ()))(keys)[:, None]
    threshold = jnp.minimum(u * total, jnp.nextafter(total, 0.0))
    index = jnp.arange(vocab, dtype=jnp.int32)
    first = jnp.min(jnp.where((mass > threshold) & (weights > 0), index, vocab), axis=-1)
    return jnp.where(first < vocab, first, _argmax(scaled))


def _argmax(x, chunk=128):
    """First index of each row's maximum, as jnp.argmax, from plain reductions that XLA:CPU
    vectorises (its fused value-and-index reduce cost as much as the LM head): the maxima of
    chunks of the row, the first chunk holding the row's maximum, the first index in it. Only
    that chunk is compared against the maximum, not the whole [B, V] row (190 -> 50 us at
    [32, 4096] on a 2-core VM)."""
    b, v = x.shape
    if v % chunk:
        chunk = v
    chunks = x.reshape(b, v // chunk, chunk)
    chunk_max = chunks.max(axis=-1)  # [B, V/c]
    top = chunk_max.max(axis=-1, keepdims=True)
    first = _first_index(chunk_max == top)  # [B]
    within = jnp.take_along_axis(chunks, first[:, None, None], axis=1)[:, 0]  # [B, c]
    return first * chunk + _first_index(within == top)


def _first_index(hit):
    """Index of the first True of each row of hit [B, n] (n - 1 if none)."""
    n = hit.shape[-1]
    return jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), n - 1), axis=-1)


def _log_softmax_at(x, tokens):
    """log_softmax(x)[row, tokens[row]] without materialising the whole log-softmax. Not
    jaxagent.rl.token_logprobs: that one also prepares the entropy, and the decode step
    measured 5-10% slower with it."""
    top = x.max(axis=-1, keepdims=True)
    log_total = jnp.log(jnp.sum(jnp.exp(x - top), axis=-1)) + top[:, 0]
    return jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - log_total


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
    # On CPU a dense model's steps read a transposed copy of the keys, made once per segment
    # (XLA:CPU's q.K over the minor head dim is slow; accelerators need no second copy).
    transposed = (model.config.attention == "dense" and backend_name(model.config) == "xla"
                  and jax.default_backend() == "cpu")
    if transposed:
        state = dict(state, cache=state["cache"].with_keys_transposed())

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

    state = jax.lax.while_loop(cond, body, state)
    return dict(state, cache=state["cache"].without_keys_transposed()) if transposed else state


_grow_cache = jax.jit(KVCache.grow, static_argnames=("cfg", "extra"))


@jax.jit
def _stack_layers(cache: KVCache) -> jax.Array:
    """[B, Y, 2, K, S, H]: every layer's k and v of each row (the KV store's entry layout)."""
    return jnp.stack([jnp.stack(kv, axis=1) for kv in zip(cache.k, cache.v)], axis=1)


@functools.partial(jax.jit, static_argnames=("extra",))
def _documents_cache(kv, segment_ids, extra: int) -> KVCache:
    """A cache from rows of document KV laid end to end, kv [Y, 2, K, B*W, H] with segment_ids
    [B, W], written up to W, with `extra` empty slots after."""
    batch, width = segment_ids.shape
    y, _, k, _, h = kv.shape
    kv = kv.reshape(y, 2, k, batch, width, h).transpose(0, 1, 3, 2, 4, 5)  # [Y, 2, B, K, W, H]
    kv = jnp.pad(kv, [(0, 0)] * 4 + [(0, extra), (0, 0)])
    return KVCache(k=[kv[i, 0] for i in range(y)], v=[kv[i, 1] for i in range(y)],
                   segment_ids=jnp.pad(segment_ids, [(0, 0), (0, extra)]),
                   index=jnp.int32(width))


def _finish_reason(tokens: np.ndarray, stop_ids: set[int]) -> str:
    return "stop" if tokens.size and int(tokens[-1]) in stop_ids else "length"


def _take_rows(tree, index):
    """Gather batch rows of every [B, ...] array in a pytree (scalars pass through)."""
    return jax.tree.map(lambda x: x[index] if x.ndim else x, tree)


_take_rows_jit = jax.jit(_take_rows)


class Sampler:
    """Generates completions for token prompts with a Flax NNX decoder.

    `update_weights(model)` swaps in new parameters without recompiling (same shapes).
    `generate(..., documents=)` reuses document KVs from `kv_store` (one per sampler unless
    given, so samplers of one model can share it).
    """

    def __init__(self, model, tokenizer=None, *, prompt_bucket: int = 64, cache_bucket: int = 64,
                 batch_bucket: int = 8, segment_steps: int = 32, prefix_sharing: bool = True,
                 compact: bool = True, kv_store: KVStore | None = None,
                 host_threads: int | None = None):
        self.graphdef, self.params = nnx.split(model)
        self._weights_id = next(_WEIGHTS_IDS)
        self.kv_store = KVStore() if kv_store is None else kv_store
        self.config = model.config
        self.tokenizer = tokenizer
        self.prompt_bucket = prompt_bucket
        self.cache_bucket = cache_bucket
        self.batch_bucket = batch_bucket
        self.segment_steps = segment_steps
        self.prefix_sharing = prefix_sharing
        self.compact = compact
        # CPU: XLA runs a small decode step's ops on one core, so a batch split across the
        # cores decodes in parallel (1.4x at batch 32 on 2 cores); None = the cores here.
        self.host_threads = host_threads

    def update_weights(self, model_or_params) -> None:
        params = model_or_params
        if isinstance(model_or_params, nnx.Module):
            params = nnx.state(model_or_params)
        self.params = params
        self._weights_id = next(_WEIGHTS_IDS)
        self.kv_store.clear()  # stored document KVs are of the old weights

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

    def _check_documents(self, documents, num_prompts: int) -> list[list[list[int]]]:
        if self.config.attention == "nsa":
            raise ValueError("documents: not supported with model.attention nsa (its blocks "
                             "assume positions that follow the cache slots)")
        if len(documents) != num_prompts:
            raise ValueError(f"documents: one list of documents per prompt, got {len(documents)} "
                             f"lists for {num_prompts} prompts")
        vocab = self.config.vocab_size
        out = []
        for i, docs in enumerate(documents):
            row = []
            for j, doc in enumerate(docs):
                ids = [int(t) for t in doc]
                if not ids:
                    raise ValueError(f"documents[{i}][{j}]: empty document")
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"documents[{i}][{j}]: token id {bad[0]} outside vocab "
                                     f"[0, {vocab})")
                row.append(ids)
            out.append(row)
        return out

    def _pad_prompts(self, prompts: list[list[int]], starts=None):
        """Left-pad to a bucketed length and a bucketed batch; padding rows have row id -1.
        Row i's positions start at `starts[i]` (default 0)."""
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
            positions[i, length - n:] = np.arange(n) + (0 if starts is None else starts[i])
        return tokens, segment_ids, positions

    def generate(self, prompts: list[list[int]], *, num_samples: int = 1, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 stop_token_ids=(), seed: int = 0,
                 documents: list[list[list[int]]] | None = None,
                 on_finish: Callable[[int, list[int], np.ndarray, str], None] | None = None,
                 row_offset: int = 0) -> SampleOutput:
        """`row_offset`: the rows sample as rows row_offset, row_offset + 1, ... (their
        per-row keys): a process's share of a global batch draws what one process drawing the
        whole batch would for those rows. Outputs and `on_finish` rows count from 0.

        `documents[i]`: the documents (token lists) before prompt i, laid out as
        `jaxagent.models.documents` says (each attends to itself; the prompt, then its
        completion, to all of them); their KVs come from `kv_store`, encoded on a miss.

        `on_finish(row, tokens, logprobs, finish_reason)` is called once per row as soon as
        the host sees it finished (between decode segments), while the other rows go on:
        a caller can score early completions during generation."""
        prompts = self._check_prompts(prompts)
        if documents is not None:
            documents = self._check_documents(documents, len(prompts))
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
        run = functools.partial(
            self._generate, num_samples=num_samples, max_new_tokens=max_new_tokens,
            temperature=jnp.float32(temperature or 1.0), top_p=jnp.float32(top_p or 1.0),
            stop_ids=stop_ids, stop_set=set(stop_token_ids), key=jax.random.key(seed), mode=mode)
        # Documents share the KV store: one thread.
        shards = (1 if documents is not None
                  else self.host_shards(len(prompts) * num_samples, len(prompts)))
        if on_finish is not None and row_offset:
            report = on_finish
            on_finish = lambda row, *rest: report(row - row_offset, *rest)  # noqa: E731
        if shards == 1:
            return run(prompts, documents, row_offset, on_finish)
        # Whole prompts per thread; row ids stay global, so keys (per step and row), outputs
        # and on_finish's rows are those of one call.
        t0 = time.perf_counter()
        bounds = np.linspace(0, len(prompts), shards + 1).astype(int)
        lock = threading.Lock()

        def finished(*args):
            with lock:
                on_finish(*args)

        with ThreadPoolExecutor(shards) as pool:
            parts = list(pool.map(
                lambda ab: run(prompts[ab[0]:ab[1]], None, row_offset + int(ab[0]) * num_samples,
                               on_finish and finished), zip(bounds, bounds[1:])))
        stats = {k: sum(p.stats[k] for p in parts) for k in parts[0].stats}
        stats.update(prefill_seconds=max(p.stats["prefill_seconds"] for p in parts),
                     seconds=time.perf_counter() - t0, host_threads=shards)
        return SampleOutput([t for p in parts for t in p.tokens],
                            [lp for p in parts for lp in p.logprobs],
                            [r for p in parts for r in p.finish_reasons], stats, self.tokenizer)

    def host_shards(self, rows: int, groups: int) -> int:
        """Threads to split `rows` decoding rows (in `groups` that stay whole) over: on a CPU
        backend with single-device weights (a mesh's programs must not interleave), at least
        `batch_bucket` rows each."""
        if jax.default_backend() != "cpu":
            return 1
        if any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(self.params)):
            return 1
        threads = self.host_threads or _usable_cores()
        return max(1, min(threads, groups, rows // self.batch_bucket))

    def _generate(self, prompts, documents, row_offset: int, on_finish, *, num_samples: int,
                  max_new_tokens: int, temperature, top_p, stop_ids, stop_set, key,
                  mode) -> SampleOutput:
        """One batch: rows row_offset + [0, len(prompts) * num_samples)."""
        g = num_samples
        num_rows = len(prompts) * g
        t0 = time.perf_counter()

        # Prefill: each distinct prompt once (prefix sharing), or every row (for comparison).
        repeat = g if self.prefix_sharing else 1
        to_prefill = [p for p in prompts for _ in range(g // repeat)]
        if documents is None:
            tokens, segment_ids, positions = self._pad_prompts(to_prefill)
            logits, cache = _prefill(self.graphdef, self.params, tokens, segment_ids, positions)
            next_positions = np.array([len(p) for p in to_prefill])
            stats = dict(prefill_rows=int(tokens.shape[0]), prefill_tokens=int(segment_ids.sum()))
        else:
            to_documents = [d for d in documents for _ in range(g // repeat)]
            logits, cache, next_positions, stats = self._prefill_documents(to_prefill,
                                                                           to_documents)
        batch = _round_up(num_rows, self.batch_bucket)
        # Decoding row r reads prefill row r // repeat; rows past num_rows are padding.
        source = np.minimum(np.arange(batch) // repeat, len(to_prefill) - 1)
        cache, logits = _take_rows_jit((cache, logits), source)
        rows = np.where(np.arange(batch) < num_rows, row_offset + np.arange(batch),
                        -1).astype(np.int32)
        jax.block_until_ready(logits)  # so prefill_seconds times the prefill, not its dispatch
        prefill_s = time.perf_counter() - t0

        max_new = _round_up(max_new_tokens, 64)
        first, first_lp, done = _first_tokens(logits, rows, key, temperature, top_p, stop_ids,
                                              mode=mode)
        lengths = next_positions[source]
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
        reported: set[int] = set()

        def report():
            for r in sorted(results.keys() - reported):
                toks, lps = results[r]
                on_finish(r, toks.tolist(), lps, _finish_reason(toks, stop_set))
                reported.add(r)

        step, used_slots = 1, cache.size
        decode_rows = 0
        while step < max_new_tokens:
            if self.compact:
                state = self._maybe_compact(state, results)
            if state is None:
                break
            n = min(self.segment_steps, max_new_tokens - step)
            free = state["cache"].size - used_slots
            if free < n:
                state["cache"] = _grow_cache(state["cache"], cfg=self.config,
                                             extra=_round_up(n - free, self.cache_bucket))
            state = _decode_segment(self.graphdef, self.params, state, jnp.int32(step + n),
                                    jnp.int32(max_new_tokens), key, temperature, top_p,
                                    stop_ids, mode=mode)
            new_step = int(state["step"])
            decode_rows += (new_step - step) * state["done"].shape[0]
            used_slots += new_step - step
            step = new_step
            if bool(jnp.all(state["done"])):
                break
            if on_finish is not None:
                self._collect(state, np.asarray(state["done"]), results)
                report()
        if state is not None:
            self._collect(state, np.ones(state["done"].shape[0], bool), results)
        if on_finish is not None:
            report()

        out_tokens, out_logprobs, reasons = [], [], []
        for r in range(row_offset, row_offset + num_rows):
            toks, lps = results[r]
            out_tokens.append(toks.tolist())
            out_logprobs.append(lps)
            reasons.append(_finish_reason(toks, stop_set))
        stats.update(prefill_seconds=prefill_s, decode_row_steps=decode_rows,
                     generated_tokens=sum(map(len, out_tokens)),
                     seconds=time.perf_counter() - t0)
        return SampleOutput(out_tokens, out_logprobs, reasons, stats, self.tokenizer)

    # -----------------------------------------------------------------------------------------
    # Document prompts: cached document KVs, then the prompt prefilled onto them.

    def _encode_documents(self, documents: list[tuple[list[int], int]]) -> list[jax.Array]:
        """Prefill each (tokens, first position) alone, in one batch; [Y, 2, K, n, H] each."""
        tokens, segment_ids, positions = self._pad_prompts([t for t, _ in documents],
                                                           [s for _, s in documents])
        _, cache = _prefill(self.graphdef, self.params, tokens, segment_ids, positions)
        kv = _stack_layers(cache)
        width = tokens.shape[1]
        return [kv[i, :, :, :, width - len(t):] for i, (t, _) in enumerate(documents)]

    def _prefill_documents(self, prompts: list[list[int]], documents: list[list[list[int]]]):
        """Assemble each row's cache from its documents' stored KVs (left-padded to a shared
        width, one segment: causal attention over the slots is "sees every document"), then
        prefill the prompt onto it at its final-section positions."""
        cfg = self.config
        layouts = [document_layout([len(d) for d in docs], len(p), cfg.documents)
                   for p, docs in zip(prompts, documents)]
        items = []
        for docs, (_, positions) in zip(documents, layouts):
            offsets = np.cumsum([0, *map(len, docs)])[:-1]
            items += [(d, int(positions[o])) for d, o in zip(docs, offsets)]
        tag = f"{cfg!r}#{self._weights_id}"
        entries, store_stats = self.kv_store.lookup(tag, items, self._encode_documents)

        doc_lengths = [sum(map(len, docs)) for docs in documents]
        width = _round_up(max(doc_lengths), self.prompt_bucket)
        tokens, segment_ids, positions = self._pad_prompts(
            prompts, [int(pos[-len(p)]) for p, (_, pos) in zip(prompts, layouts)])
        batch = tokens.shape[0]

        def empty(n):
            return jnp.zeros((cfg.num_layers, 2, cfg.num_kv_heads, n, cfg.head_dim), cfg.dtype)

        pieces, doc_segments = [], np.zeros((batch, width), np.int32)
        it = iter(entries)
        for r in range(batch):
            n = doc_lengths[r] if r < len(prompts) else 0
            pieces.append(empty(width - n))
            pieces += [next(it) for _ in (documents[r] if r < len(prompts) else ())]
            doc_segments[r, width - n:] = 1
        cache = _documents_cache(jnp.concatenate(pieces, axis=3), doc_segments,
                                 extra=tokens.shape[1])
        logits, cache = _extend(self.graphdef, self.params, cache, tokens, segment_ids, positions)
        next_positions = np.array([int(pos[-1]) + 1 for _, pos in layouts])
        stats = dict(prefill_rows=batch,
                     prefill_tokens=int(segment_ids.sum()) + store_stats["tokens_encoded"],
                     kv_store=store_stats)
        return logits, cache, next_positions, stats

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


# ---------------------------------------------------------------------------------------------
# Multi-turn continuation: episodes keep their KV cache rows between turns.


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _extend(graphdef, params, cache, tokens, segment_ids, positions):
    """Write one left-padded chunk per row at the cache's next slots; the last logits [B, V]."""
    model = nnx.merge(graphdef, params)
    logits, cache = model(tokens, positions, segment_ids, cache, last_only=True)
    return logits[:, 0], cache


@functools.partial(jax.jit, donate_argnames=("cache",))
def _forget_slots(cache: KVCache, keep):
    """Mark the slots where `keep` [B, S] is False as empty (segment 0: attended by nothing)."""
    return dataclasses.replace(cache, segment_ids=cache.segment_ids * keep)


def _fresh_cache(config, batch: int, size: int) -> KVCache:
    """An empty cache whose arrays are distinct buffers (`KVCache.empty` shares one zeros array
    between layers and k/v, which cannot be donated)."""
    return jax.tree.map(jnp.copy, KVCache.empty(config, batch, size))


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
    use (padding, decode steps after it stopped, a finished episode) are marked empty. The cache
    grows by `cache_bucket`; past `max_cache_slots` it is rebuilt by re-prefilling the live
    histories (the only whole-history prefill).
    """

    def __init__(self, sampler: Sampler, slots: int, *, max_new_tokens: int,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 stop_token_ids=(), seed: int = 0, max_cache_slots: int = 1 << 15,
                 row_offset: int = 0):
        if slots < 1:
            raise ValueError(f"slots: must be >= 1, got {slots}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        stop_token_ids = tuple(int(t) for t in stop_token_ids)
        if len(stop_token_ids) > _MAX_STOP_IDS:
            raise ValueError(f"stop_token_ids: at most {_MAX_STOP_IDS}, got {len(stop_token_ids)}")
        self.sampler, self.slots = sampler, slots
        self.row_offset = row_offset  # slot i samples as row row_offset + i (ThreadedContinuation)
        self.batch = _round_up(slots, sampler.batch_bucket)
        self.max_new_tokens, self.max_cache_slots = max_new_tokens, max_cache_slots
        self.mode = _SamplingMode(greedy=temperature == 0, top_k=top_k, top_p=top_p is not None)
        self.stop_set = set(stop_token_ids)
        self.stop_ids = jnp.asarray(stop_token_ids + (-1,) * (_MAX_STOP_IDS - len(stop_token_ids)),
                                    jnp.int32)
        self.temperature = jnp.float32(temperature or 1.0)
        self.top_p = jnp.float32(top_p or 1.0)
        self.key = jax.random.key(seed)
        self.history: list[list[int] | None] = [None] * self.batch  # None: a free slot
        self.pending: list[list[int]] = [[] for _ in range(self.batch)]
        self.positions = np.zeros(self.batch, np.int32)  # tokens of the episode in the cache
        self.cache = _fresh_cache(sampler.config, self.batch, sampler.cache_bucket)
        self.used = 0  # host copy of cache.index
        self.turns = 0
        self.stats = {"prefill_tokens": 0, "prefill_slots": 0, "decode_row_steps": 0, "rebuilds": 0}

    # ---- episodes ----
    def start(self, slot: int, prompt) -> None:
        self._check_slot(slot)
        if self.history[slot] is not None:
            raise ValueError(f"slot {self.row_offset + slot} is busy; release() it first")
        prompt = self.sampler._check_prompts([prompt])[0]
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

    # ---- cache room ----
    def _reserve(self, cache: KVCache, needed: int) -> KVCache:
        free = cache.size - self.used
        if free < needed:
            cache = _grow_cache(cache, cfg=self.sampler.config,
                                extra=_round_up(needed - free, self.sampler.cache_bucket))
        return cache

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
        lengths = [len(p) for p in self.pending]
        chunk = _round_up(max(max(lengths), 1), self.sampler.prompt_bucket)
        if self.used + chunk + self.max_new_tokens > self.max_cache_slots and self.used:
            self._rebuild()
            return self.prefill()
        tokens = np.zeros((self.batch, chunk), np.int32)
        segment_ids = np.zeros((self.batch, chunk), np.int32)
        positions = np.zeros((self.batch, chunk), np.int32)
        for i, p in enumerate(self.pending):
            if p:
                tokens[i, chunk - len(p):] = p
                segment_ids[i, chunk - len(p):] = 1
                positions[i, chunk - len(p):] = self.positions[i] + np.arange(len(p))
        cache = self._reserve(self.cache, chunk)
        logits, self.cache = _extend(self.sampler.graphdef, self.sampler.params, cache, tokens,
                                     segment_ids, positions)
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
        s = self.sampler
        key = jax.random.fold_in(self.key, self.turns)
        rows = np.where(active, self.row_offset + np.arange(self.batch), -1).astype(np.int32)
        first, first_lp, done = _first_tokens(logits, rows, key, self.temperature, self.top_p,
                                              self.stop_ids, mode=self.mode)
        max_new = _round_up(self.max_new_tokens, 64)
        state = {
            "cache": self.cache,
            "tokens": jnp.zeros((self.batch, max_new), jnp.int32).at[:, 0].set(first),
            "logprobs": jnp.zeros((self.batch, max_new), jnp.float32).at[:, 0].set(first_lp),
            "lengths": jnp.asarray(rows >= 0, jnp.int32),
            "positions": jnp.asarray(self.positions),
            "done": done | (self.max_new_tokens == 1),
            "rows": jnp.asarray(rows),
            "step": jnp.int32(1),
        }
        start, step = self.used, 1
        while step < self.max_new_tokens and not bool(jnp.all(state["done"])):
            n = min(s.segment_steps, self.max_new_tokens - step)
            state["cache"] = self._reserve(state["cache"], (step - 1) + n)
            state = _decode_segment(s.graphdef, s.params, state, jnp.int32(step + n),
                                    jnp.int32(self.max_new_tokens), key, self.temperature,
                                    self.top_p, self.stop_ids, mode=self.mode)
            new_step = int(state["step"])
            self.stats["decode_row_steps"] += (new_step - step) * self.batch
            step = new_step
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
            reason = "stop" if toks and toks[-1] in self.stop_set else "length"
            out[i] = (toks, logprobs[i, :n], reason)
        self.cache = _forget_slots(self.cache, jnp.asarray(keep))
        self.turns += 1
        return out


class ThreadedContinuation:
    """`Continuation`'s interface over parts that each hold a range of the slots with their own
    cache, turned in parallel host threads (CPU, see `Sampler.host_shards`). Slot i samples
    with the keys of row i, so the actions are those of one `Continuation`."""

    def __init__(self, sampler: Sampler, slots: int, parts: int, **kwargs):
        bounds = np.linspace(0, slots, parts + 1).astype(int)
        self.slots = slots
        self.parts = [Continuation(sampler, int(b - a), row_offset=int(a), **kwargs)
                      for a, b in zip(bounds, bounds[1:])]
        self._part_of = np.repeat(np.arange(parts), np.diff(bounds))

    def _locate(self, slot: int) -> tuple[Continuation, int]:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside [0, {self.slots})")
        part = self.parts[self._part_of[slot]]
        return part, slot - part.row_offset

    def start(self, slot: int, prompt) -> None:
        part, i = self._locate(slot)
        part.start(i, prompt)

    def append(self, slot: int, tokens) -> None:
        part, i = self._locate(slot)
        part.append(i, tokens)

    def release(self, slot: int) -> None:
        part, i = self._locate(slot)
        part.release(i)

    def turn(self) -> dict[int, tuple[list[int], np.ndarray, str]]:
        with ThreadPoolExecutor(len(self.parts)) as pool:
            outs = list(pool.map(Continuation.turn, self.parts))
        return {p.row_offset + i: action for p, out in zip(self.parts, outs)
                for i, action in out.items()}

    @property
    def stats(self) -> dict:
        return {k: sum(p.stats[k] for p in self.parts) for k in self.parts[0].stats}


def continuation(sampler: Sampler, slots: int, **kwargs) -> Continuation | ThreadedContinuation:
    """A `Continuation` of `slots` episodes, split over host threads where the sampler would
    split a batch of that many rows."""
    parts = sampler.host_shards(slots, slots)
    if parts == 1:
        return Continuation(sampler, slots, **kwargs)
    return ThreadedContinuation(sampler, slots, parts, **kwargs)
