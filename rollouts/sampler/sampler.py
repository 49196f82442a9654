"""`Sampler`: completions for a batch of prompts; prefix-shared prefill, compacted decoding."""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxagent.models import compute_weights
from rollouts.kv_store import KVStore
from rollouts.sampler.decode import (
    SampleOutput,
    Sampling,
    _round_up,
    check_prompts,
    decode,
    left_pad,
)
from rollouts.sampler.documents import DocumentPrompts
from rollouts.sampler.programs import _prefill, _take_rows
from rollouts.sampler.threads import generate_in_threads
from sharding.rules import host_value

_WEIGHTS_IDS = itertools.count()  # a fresh id per weights a sampler holds (KV store keys)


def _usable_cores() -> int:
    """Cores this process may run on (the affinity mask where the OS has one: Linux)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class Sampler(DocumentPrompts):
    """Generates completions for token prompts with a Flax NNX decoder.

    `update_weights(model)` swaps in new parameters without recompiling (same shapes).
    `generate(..., documents=)` reuses document KVs from `kv_store` (one per sampler unless
    given, so samplers of one model can share it).
    """

    def __init__(self, model, tokenizer=None, *, prompt_bucket: int = 64, cache_bucket: int = 64,
                 batch_bucket: int = 8, segment_steps: int = 32, prefix_sharing: bool = True,
                 compact: bool = True, kv_store: KVStore | None = None,
                 host_threads: int | None = None,
                 activations: Callable[[], contextlib.AbstractContextManager] | None = None):
        self.graphdef, params = nnx.split(model)
        self.params = compute_weights(params, model.config)  # sampling needs no float32 masters
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
        # The rules context the model's activations are pinned in (sharding's
        # `Layout.sampler_activations`); None: no constraints.
        self.activations = activations or contextlib.nullcontext

    def run(self, program, *args, **kwargs):
        """A program that runs the model (`programs.py`: its graphdef and params first), called
        in this sampler's rules context, in whichever thread calls."""
        with self.activations():
            return program(self.graphdef, self.params, *args, **kwargs)

    def update_weights(self, model_or_params) -> None:
        params = model_or_params
        if isinstance(model_or_params, nnx.Module):
            params = nnx.state(model_or_params)
        self.params = compute_weights(params, self.config)
        self._weights_id = next(_WEIGHTS_IDS)
        self.kv_store.clear()  # stored document KVs are of the old weights

    # -----------------------------------------------------------------------------------------

    def _pad_prompts(self, prompts: list[list[int]], starts=None):
        """Left-pad to a bucketed length and a bucketed batch. Row i's positions start at
        `starts[i]` (default 0)."""
        length = _round_up(max(map(len, prompts)), self.prompt_bucket)
        # Powers of two below one batch bucket, so one shared prompt prefills one row.
        n = len(prompts)
        batch = 1 << (n - 1).bit_length() if n < self.batch_bucket else _round_up(n, self.batch_bucket)
        return left_pad(prompts, length, batch, starts)

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
        prompts = check_prompts(prompts, self.config.vocab_size)
        if documents is not None:
            documents = self._check_documents(documents, len(prompts))
        if num_samples < 1:
            raise ValueError(f"num_samples: must be >= 1, got {num_samples}")
        sampling = Sampling.checked(self.config.vocab_size, max_new_tokens=max_new_tokens,
                                    temperature=temperature, top_k=top_k, top_p=top_p,
                                    stop_token_ids=stop_token_ids)
        run = functools.partial(self._generate, num_samples=num_samples, sampling=sampling,
                                key=jax.random.key(seed))
        # Documents share the KV store: one thread.
        shards = (1 if documents is not None
                  else self.host_shards(len(prompts) * num_samples, len(prompts)))
        if on_finish is not None and row_offset:
            report = on_finish
            on_finish = lambda row, *rest: report(row - row_offset, *rest)  # noqa: E731
        if shards == 1:
            return run(prompts, documents, row_offset, on_finish)
        return generate_in_threads(run, prompts, shards, num_samples, row_offset, on_finish,
                                   self.tokenizer)

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
                  sampling: Sampling, key) -> SampleOutput:
        """One batch: rows row_offset + [0, len(prompts) * num_samples)."""
        g = num_samples
        num_rows = len(prompts) * g
        t0 = time.perf_counter()

        # Prefill: each distinct prompt once (prefix sharing), or every row (for comparison).
        repeat = g if self.prefix_sharing else 1
        to_prefill = [p for p in prompts for _ in range(g // repeat)]
        if documents is None:
            tokens, segment_ids, positions = self._pad_prompts(to_prefill)
            logits, cache = self.run(_prefill, tokens, segment_ids, positions)
            next_positions = np.array([len(p) for p in to_prefill])
            stats = dict(prefill_rows=int(tokens.shape[0]), prefill_tokens=int(segment_ids.sum()))
        else:
            to_documents = [d for d in documents for _ in range(g // repeat)]
            logits, cache, next_positions, stats = self._prefill_documents(to_prefill,
                                                                           to_documents)
        batch = _round_up(num_rows, self.batch_bucket)
        # Decoding row r reads prefill row r // repeat; rows past num_rows are padding.
        source = np.minimum(np.arange(batch) // repeat, len(to_prefill) - 1)
        cache, logits = _take_rows((cache, logits), source)
        rows = np.where(np.arange(batch) < num_rows, row_offset + np.arange(batch),
                        -1).astype(np.int32)
        jax.block_until_ready(logits)  # so prefill_seconds times the prefill, not its dispatch
        prefill_s = time.perf_counter() - t0

        results: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        reported: set[int] = set()

        def report():
            for r in sorted(results.keys() - reported):
                toks, lps = results[r]
                on_finish(r, toks.tolist(), lps, sampling.finish_reason(toks))
                reported.add(r)

        def report_finished(state):
            self._collect(state, host_value(state["done"]), results)
            report()

        compact = functools.partial(self._maybe_compact, results=results)
        state, _, decode_rows = decode(
            self, sampling, key, cache, logits, rows, next_positions[source], used=cache.size,
            before=compact if self.compact else None,
            after=report_finished if on_finish is not None else None)
        self._collect(state, np.ones(state["done"].shape[0], bool), results)
        if on_finish is not None:
            report()

        out_tokens, out_logprobs, reasons = [], [], []
        for r in range(row_offset, row_offset + num_rows):
            toks, lps = results[r]
            out_tokens.append(toks.tolist())
            out_logprobs.append(lps)
            reasons.append(sampling.finish_reason(toks))
        stats.update(prefill_seconds=prefill_s, decode_row_steps=decode_rows,
                     generated_tokens=sum(map(len, out_tokens)),
                     seconds=time.perf_counter() - t0)
        return SampleOutput(out_tokens, out_logprobs, reasons, stats, self.tokenizer)

    @staticmethod
    def _collect(state, which: np.ndarray, results: dict) -> None:
        """Copy the outputs of rows `which` (a batch mask) to the host `results`."""
        rows, lengths, tokens, logprobs = host_value(
            (state["rows"], state["lengths"], state["tokens"], state["logprobs"]))
        for i in np.flatnonzero(which):
            if rows[i] >= 0 and rows[i] not in results:
                n = lengths[i]
                results[int(rows[i])] = (tokens[i, :n], logprobs[i, :n])

    def _maybe_compact(self, state, results):
        """Halve the batch once half its rows are done (`decode` calls this while rows live)."""
        done = host_value(state["done"])
        batch = done.shape[0]
        live = np.flatnonzero(~done)
        target = _round_up(max(batch // 2, 1), self.batch_bucket)
        if live.size > target or target >= batch:
            return state
        self._collect(state, done, results)
        # Fill the smaller batch with live rows, then finished rows as padding (marked dead).
        index = np.concatenate([live, np.flatnonzero(done)])[:target]
        state = _take_rows(state, index)
        pad = np.arange(target) >= live.size
        state["rows"] = jnp.where(pad, -1, state["rows"])
        state["done"] = state["done"] | pad
        return state
