"""The jitted programs the sampler runs, and the cache and batch edits between them. Each compiles
once per bucketed shape (batch, prompt length, cache size, output buffer)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxagent.models.llama import KVCache, backend_name
from rollouts.sampler.sampling import _row_keys, sample_tokens


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _prefill(graphdef, params, tokens, segment_ids, positions):
    model = nnx.merge(graphdef, params)
    cache = KVCache.empty(model.config, tokens.shape[0], tokens.shape[1])
    logits, cache = model(tokens, positions, segment_ids, cache, last_only=True)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _extend(graphdef, params, cache, tokens, segment_ids, positions):
    """Write one left-padded chunk per row at the cache's next slots; the last logits [B, V]."""
    model = nnx.merge(graphdef, params)
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
    transposed = (model.config.attention == "dense" and backend_name(model.config, "cached") == "xla"
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
def _take_rows(tree, index):
    """Gather batch rows of every [B, ...] array in a pytree (scalars pass through)."""
    return jax.tree.map(lambda x: x[index] if x.ndim else x, tree)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _forget_slots(cache: KVCache, keep):
    """Mark the slots where `keep` [B, S] is False as empty (segment 0: attended by nothing)."""
    return dataclasses.replace(cache, segment_ids=cache.segment_ids * keep)


@jax.jit
def _pack_slots(cache: KVCache, source, keep, index) -> KVCache:
    """A cache whose row b's slot j holds its old slot `source[b, j]` [B, S'] (S' the new size),
    empty where `keep` [B, S'] is 0, written up to `index`. Keys carry their positions (RoPE is
    applied before they are cached) and visibility is by slot order, which a row's slots keep."""
    take = lambda x: jnp.take_along_axis(x, source[:, None, :, None], axis=2)
    return dataclasses.replace(
        cache, k=[take(x) for x in cache.k], v=[take(x) for x in cache.v],
        segment_ids=jnp.take_along_axis(cache.segment_ids, source, axis=1) * keep, index=index)


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
