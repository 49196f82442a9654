import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig, NSAConfig
from rollouts import sampler as sampler_lib
from rollouts.sampler import Continuation, Sampler, ThreadedContinuation, continuation
from rollouts.sampler.decode import _round_up

CFG = ModelConfig(vocab_size=67, hidden_size=36, intermediate_size=53, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=10, tie_embeddings=False)
# One host thread: these tests pin batch mechanics (compaction, buckets); threads have their own.
OPTS = dict(prompt_bucket=8, cache_bucket=16, batch_bucket=4, segment_steps=6, host_threads=1)


@pytest.fixture(scope="module")
def model():
    return _peaked(init_model(CFG, seed=0))


def _peaked(m):
    """Larger weights than the default init give peaked, token-varied distributions."""
    state = nnx.state(m, nnx.Param)
    nnx.update(m, jax.tree.map(lambda x: x * 6.0 if x.ndim > 1 else x, state))
    return m


@pytest.fixture(scope="module")
def nsa_model():
    """NSA with small blocks, so 40-token histories have 5+ selection blocks to choose from."""
    nsa = NSAConfig(compress_block=8, compress_stride=4, select_block=8, num_selected=4, window=5)
    return _peaked(init_model(dataclasses.replace(CFG, attention="nsa", nsa=nsa), seed=1))


@nnx.jit
def forward(model, tokens):
    return model(tokens)


def prompts_of(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def teacher_forced_logprobs(model, prompt, tokens, temperature=1.0):
    seq = jnp.asarray([prompt + tokens])
    logp = jax.nn.log_softmax(forward(model, seq)[0] / temperature, axis=-1)
    return np.asarray([logp[len(prompt) - 1 + i, t] for i, t in enumerate(tokens)])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_log_softmax(model, temperature):
    prompts = prompts_of([5, 11, 3])
    out = Sampler(model, **OPTS).generate(prompts, num_samples=2, max_new_tokens=23,
                                          temperature=temperature, seed=3)
    assert len(out.tokens) == 6
    for r, tokens in enumerate(out.tokens):
        assert len(tokens) == len(out.logprobs[r]) == 23
        ref = teacher_forced_logprobs(model, prompts[r // 2], tokens, temperature)
        np.testing.assert_allclose(out.logprobs[r], ref, atol=1e-4)
    # Different samples of one prompt differ (each row has its own randomness).
    assert out.tokens[0] != out.tokens[1]


def test_argmax_and_log_softmax_at_match_jax():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((7, 53)).astype(np.float32)
    logits[:, 11] = logits[:, 40] = logits.max(-1) + 1  # ties: the first index wins
    logits[3] = 0.0
    tokens = sampler_lib._argmax(jnp.asarray(logits))
    np.testing.assert_array_equal(tokens, np.asarray(jnp.argmax(logits, -1)))
    assert (np.asarray(tokens) == 11).sum() == 6 and int(tokens[3]) == 0
    # a vocabulary of whole 128-wide chunks: ties across and within chunks, the last index
    wide = rng.standard_normal((6, 640)).astype(np.float32)
    top = wide.max(-1) + 1
    wide[0, [400, 130]] = top[0]  # across chunks
    wide[1, [261, 260]] = top[1]  # within a chunk
    wide[2] = 0.0
    wide[3, 639] = top[3]
    wide[4, [127, 128]] = top[4]  # across a chunk edge
    np.testing.assert_array_equal(sampler_lib._argmax(jnp.asarray(wide)), np.argmax(wide, -1))
    assert np.asarray(sampler_lib._argmax(jnp.asarray(wide)))[:5].tolist() == [130, 260, 0, 639, 127]
    x = logits.astype(np.float64) * 30  # large logits: the max shift must be right
    ref = x - x.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
    picks = rng.integers(0, 53, 7)
    np.testing.assert_allclose(
        sampler_lib._log_softmax_at(jnp.asarray(x, jnp.float32), jnp.asarray(picks)),
        ref[np.arange(7), picks], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("top_k", [None, 6])
def test_sampled_frequencies_match_the_tempered_distribution(top_k):
    """20,000 draws from one row: frequencies within 4 sigma of softmax(logits / T) (top-k
    renormalised), masked tokens never drawn, and each draw's log-prob is that distribution's."""
    logits = np.random.default_rng(5).normal(0, 1.5, (1, 9)).astype(np.float32)
    n, temperature = 20_000, 0.7
    mode = sampler_lib._SamplingMode(greedy=False, top_k=top_k, top_p=False)
    keys = jax.random.split(jax.random.key(0), n)
    tokens, logp = jax.jit(lambda k: sampler_lib.sample_tokens(
        jnp.repeat(jnp.asarray(logits), n, 0), k, temperature, 1.0, mode))(keys)
    scaled = np.float64(logits[0]) / temperature
    keep = scaled >= np.sort(scaled)[-top_k] if top_k else np.ones(9, bool)
    p = np.where(keep, np.exp(scaled - scaled.max()), 0.0)
    p /= p.sum()
    freq = np.bincount(np.asarray(tokens), minlength=9) / n
    assert (freq[~keep] == 0).all()
    np.testing.assert_array_less(np.abs(freq - p), 4 * np.sqrt(p * (1 - p) / n) + 1e-4)
    np.testing.assert_allclose(np.asarray(logp), np.log(p[np.asarray(tokens)]), atol=1e-5)


def test_top_k_logprobs_are_of_the_truncated_distribution(model):
    prompts = prompts_of([6])
    out = Sampler(model, **OPTS).generate(prompts, max_new_tokens=9, temperature=1.0, top_k=3)
    seq = jnp.asarray([prompts[0] + out.tokens[0]])
    logits = np.asarray(forward(model, seq)[0], np.float64)
    for i, token in enumerate(out.tokens[0]):
        row = logits[len(prompts[0]) - 1 + i]
        top = np.argsort(row)[-3:]
        assert token in top
        ref = row[token] - np.log(np.exp(row[top]).sum())
        assert abs(out.logprobs[0][i] - ref) < 1e-4


def test_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.split(jax.random.key(0), 2000)
    mode = sampler_lib._SamplingMode(greedy=False, top_k=None, top_p=True)
    tokens, logp = sampler_lib.sample_tokens(logits, keys, 1.0, 0.75, mode)
    counts = np.bincount(np.asarray(tokens), minlength=4) / 2000
    assert counts[2] == counts[3] == 0  # 0.5 + 0.3 >= 0.75: two tokens kept
    assert abs(counts[0] - 0.625) < 0.04
    np.testing.assert_allclose(np.exp(np.asarray(logp))[tokens == 0], 0.625, rtol=1e-5)


def test_prefix_sharing_gives_the_same_tokens_as_separate_prefills(model):
    prompts = prompts_of([7, 4])
    shared = Sampler(model, **OPTS).generate(prompts, num_samples=3, max_new_tokens=17, seed=5)
    separate = Sampler(model, prefix_sharing=False, **OPTS).generate(
        prompts, num_samples=3, max_new_tokens=17, seed=5)
    assert shared.tokens == separate.tokens
    for a, b in zip(shared.logprobs, separate.logprobs):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # The shared run prefilled each prompt once, the separate run every row.
    assert shared.stats["prefill_tokens"] == 11
    assert separate.stats["prefill_tokens"] == 33


def test_greedy_is_deterministic_and_independent_of_batching(model):
    prompts = prompts_of([3, 9, 6, 12, 5])
    sampler = Sampler(model, **OPTS)
    batched = sampler.generate(prompts, max_new_tokens=15, temperature=0.0, seed=1)
    again = sampler.generate(prompts, max_new_tokens=15, temperature=0.0, seed=2)
    assert batched.tokens == again.tokens
    for i, prompt in enumerate(prompts):
        alone = sampler.generate([prompt], max_new_tokens=15, temperature=0.0)
        assert alone.tokens[0] == batched.tokens[i]
        seq = jnp.asarray([prompt + batched.tokens[i]])
        argmax = np.asarray(jnp.argmax(forward(model, seq)[0], -1))[len(prompt) - 1:-1]
        assert argmax.tolist() == batched.tokens[i]


def test_stop_tokens_end_rows_early(model):
    prompts = prompts_of([5, 8, 4, 6], seed=9)
    sampler = Sampler(model, **OPTS)
    free = sampler.generate(prompts, max_new_tokens=30, temperature=0.0)
    stop = free.tokens[0][4]
    out = sampler.generate(prompts, max_new_tokens=30, temperature=0.0, stop_token_ids=(stop,))
    for full, cut, reason in zip(free.tokens, out.tokens, out.finish_reasons):
        if stop in full:
            assert cut == full[:full.index(stop) + 1] and reason == "stop"
        else:
            assert cut == full and reason == "length"
    assert out.tokens[0][-1] == stop and len(out.tokens[0]) <= 5


def test_on_finish_reports_each_row_once_and_early_rows_during_decoding(model):
    prompts = prompts_of([5, 8, 4, 6], seed=9)
    sampler = Sampler(model, **OPTS)
    free = sampler.generate(prompts, max_new_tokens=30, temperature=0.0).tokens
    # A stop token that ends a later row within the first decode segment (6 steps) but never
    # appears in row 0: reported in row order only at the end, row 0 would come first.
    row, stop = next((r, free[r][i]) for r in (1, 2, 3) for i in range(1, 5)
                     if free[r][i] not in free[0])
    calls = []
    out = sampler.generate(prompts, max_new_tokens=30, temperature=0.0, stop_token_ids=(stop,),
                           on_finish=lambda *args: calls.append(args))
    assert sorted(c[0] for c in calls) == [0, 1, 2, 3]
    for r, tokens, logprobs, reason in calls:
        assert tokens == out.tokens[r] and reason == out.finish_reasons[r]
        np.testing.assert_array_equal(logprobs, out.logprobs[r])
    assert out.finish_reasons[0] == "length"
    assert calls[0][0] == row and calls[0][3] == "stop"


def test_host_threads_give_the_one_thread_outputs(model):
    # 5 prompts x 2 samples over 2 threads: rows 0-3 in one, 4-9 in the other (uneven
    # shards, global row ids); sampled at temperature 1, so a key from a shard-local row
    # id or step would change the tokens.
    prompts = prompts_of([5, 8, 4, 6, 3], seed=13)
    kwargs = dict(num_samples=2, max_new_tokens=19, temperature=1.0, seed=5)
    one = Sampler(model, **OPTS).generate(prompts, **kwargs)
    stop = max(set(one.tokens[7][1:10]), key=one.tokens[7][1:10].count)
    kwargs["stop_token_ids"] = (stop,)
    one = Sampler(model, **OPTS).generate(prompts, **kwargs)
    calls = []
    two = Sampler(model, **{**OPTS, "host_threads": 2}).generate(
        prompts, **kwargs, on_finish=lambda *args: calls.append(args))
    assert two.stats["host_threads"] == 2 and "host_threads" not in one.stats
    assert two.tokens == one.tokens and two.finish_reasons == one.finish_reasons
    assert "stop" in two.finish_reasons and "length" in two.finish_reasons
    for a, b in zip(two.logprobs, one.logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert sorted(c[0] for c in calls) == list(range(10))
    for r, tokens, _, reason in calls:
        assert tokens == two.tokens[r] and reason == two.finish_reasons[r]
    assert two.stats["generated_tokens"] == one.stats["generated_tokens"]


def test_compaction_keeps_results_and_saves_work(model):
    # Rows stop at different times: compaction must not change any row's tokens.
    prompts = prompts_of([4, 7, 5, 9, 3, 6, 8, 2], seed=11)
    kwargs = dict(max_new_tokens=40, temperature=0.9, seed=4)
    free = Sampler(model, **OPTS).generate(prompts, **kwargs)
    # A stop token that some rows sample early, some late and some never.
    counts = {t: sum(t in row[:25] for row in free.tokens) for t in range(CFG.vocab_size)}
    stop = min(counts, key=lambda t: abs(counts[t] - 4))
    kwargs["stop_token_ids"] = (stop,)
    compact = Sampler(model, **OPTS).generate(prompts, **kwargs)
    plain = Sampler(model, compact=False, **OPTS).generate(prompts, **kwargs)
    assert compact.tokens == plain.tokens
    assert compact.finish_reasons == plain.finish_reasons
    assert "stop" in compact.finish_reasons and "length" in compact.finish_reasons
    assert compact.stats["decode_row_steps"] < plain.stats["decode_row_steps"]


def test_no_recompilation_for_same_buckets(model):
    sampler = Sampler(model, **OPTS)
    sampler.generate(prompts_of([5, 6]), max_new_tokens=20, seed=0)
    sizes = (sampler_lib._decode_segment._cache_size(), sampler_lib._prefill._cache_size())
    sampler.generate(prompts_of([7, 3], seed=1), max_new_tokens=18, seed=1)
    assert (sampler_lib._decode_segment._cache_size(), sampler_lib._prefill._cache_size()) == sizes


def test_update_weights_changes_outputs_without_recompiling(model):
    sampler = Sampler(model, **OPTS)
    prompts = prompts_of([5])
    before = sampler.generate(prompts, max_new_tokens=12, temperature=0.0)
    size = sampler_lib._decode_segment._cache_size()
    other = init_model(CFG, seed=1)
    sampler.update_weights(other)
    after = sampler.generate(prompts, max_new_tokens=12, temperature=0.0)
    assert after.tokens != before.tokens
    assert sampler_lib._decode_segment._cache_size() == size


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompts=[]), "prompts: empty list"),
    (dict(prompts=[[1], []]), r"prompts\[1\]: empty prompt"),
    (dict(prompts=[[1, 99]]), r"prompts\[0\]: token id 99 outside vocab"),
    (dict(prompts=[[1]], num_samples=0), "num_samples"),
    (dict(prompts=[[1]], top_p=1.5), "top_p"),
    (dict(prompts=[[1]], temperature=-1.0), "temperature"),
])
def test_bad_arguments_are_named(model, kwargs, message):
    kwargs.setdefault("max_new_tokens", 4)
    with pytest.raises(ValueError, match=message):
        Sampler(model, **OPTS).generate(**kwargs)


# ---------------------------------------------------------------------------------------------
# Multi-turn continuation: prefilling only the appended tokens onto the kept KV cache gives the
# same logits as prefilling the whole history; slots are refilled; the cache is rebuilt.

STOP = 3
# One cache size and one chunk length, so each jitted function compiles once.
CONT_OPTS = {"prompt_bucket": 16, "cache_bucket": 256, "batch_bucket": 4, "segment_steps": 6}
PAD_TO = 192  # reference forwards are right-padded to one length (causal: the padding is unseen)


def full_logits(model, seq):
    """Logits of a whole-sequence prefill (no cache) [len(seq), V]."""
    assert len(seq) <= PAD_TO
    padded = jnp.asarray([seq + [0] * (PAD_TO - len(seq))])
    return np.asarray(forward(model, padded)[0, : len(seq)])


def last_logits(model, history):
    return full_logits(model, history)[-1]


def teacher_forced(model, history, action):
    logp = jax.nn.log_softmax(full_logits(model, history + action), axis=-1)
    return np.asarray([logp[len(history) - 1 + i, t] for i, t in enumerate(action)])


def tokens(rng, n):
    return rng.integers(4, CFG.vocab_size, n).tolist()


def check_turn(model, cont, before, actions):
    """Every action's log-probs equal teacher forcing on the slot's whole history."""
    for slot, (toks, logprobs, reason) in actions.items():
        assert len(toks) == len(logprobs) >= 1
        assert reason == ("stop" if toks[-1] == STOP else "length")
        np.testing.assert_allclose(logprobs, teacher_forced(model, before[slot], toks), atol=1e-4)
        assert cont.history[slot] == before[slot] + toks


def test_incremental_prefill_equals_full_reprefill(model):
    rng = np.random.default_rng(0)
    cont = Continuation(Sampler(model, **CONT_OPTS), slots=3, max_new_tokens=13, stop_token_ids=(STOP,),
                        seed=5)
    for slot, n in enumerate((5, 11, 2)):
        cont.start(slot, tokens(rng, n))
    for _ in range(4):
        before = {s: list(cont.history[s]) for s in range(3)}
        actions = cont.turn()
        assert sorted(actions) == [0, 1, 2]
        check_turn(model, cont, before, actions)
        for slot in range(3):
            cont.append(slot, tokens(rng, int(rng.integers(1, 12))))
        prefilled_before = cont.stats["prefill_tokens"]
        pending = sum(len(p) for p in cont.pending)
        logits = np.asarray(cont.prefill())
        assert cont.stats["prefill_tokens"] - prefilled_before == pending  # only the new tokens
        for slot in range(3):
            np.testing.assert_allclose(logits[slot], last_logits(model, cont.history[slot]),
                                       atol=1e-4, rtol=1e-4)
        for slot in range(3):  # the next turn needs new tokens: one more observation token each
            cont.append(slot, tokens(rng, 1))
    total = sum(len(h) for h in cont.history if h)
    assert cont.stats["prefill_tokens"] < total  # never the whole history again
    assert cont.stats["rebuilds"] == 0


def test_nsa_turns_over_a_gapped_cache_equal_teacher_forcing(nsa_model):
    """NSA's blocks are in positions while multi-turn rows leave gaps in the cache (left-padded
    chunks, decode steps after a row stopped, a released slot): decoding reaches them through the
    cache's slot map and appends compressed blocks as they close."""
    rng = np.random.default_rng(4)
    cont = Continuation(Sampler(nsa_model, **CONT_OPTS), slots=3, max_new_tokens=9,
                        stop_token_ids=(STOP,), seed=2)
    for slot, n in enumerate((6, 13, 3)):
        cont.start(slot, tokens(rng, n))
    for turn in range(3):
        before = {s: list(cont.history[s]) for s in range(3)}
        check_turn(nsa_model, cont, before, cont.turn())
        for slot in range(3):
            cont.append(slot, tokens(rng, int(rng.integers(1, 9))))
        if turn == 0:
            cont.release(2)  # a new episode reuses the row: its old blocks must not leak in
            cont.start(2, tokens(rng, 5))
    assert max(len(cont.history[s]) for s in range(3)) > 40


def test_released_slots_are_refilled_and_rebuilds_keep_the_logits(model):
    # A bound the histories outgrow: the cache is rebuilt (re-prefilled) at those turns.
    rng = np.random.default_rng(1)
    cont = Continuation(Sampler(model, **CONT_OPTS), slots=2, max_new_tokens=7, stop_token_ids=(STOP,),
                        max_cache_slots=48)
    cont.start(0, tokens(rng, 9))
    cont.start(1, tokens(rng, 4))
    for turn in range(4):
        before = {s: list(cont.history[s]) for s in range(2)}
        check_turn(model, cont, before, cont.turn())
        cont.append(0, tokens(rng, 6))
        if turn % 2:
            cont.release(1)  # the episode ended: a new one takes its slot
            cont.start(1, tokens(rng, 3))
        else:
            cont.append(1, tokens(rng, 2))
    assert cont.stats["rebuilds"] >= 1
    assert cont.history[1] is not None and len(cont.history[1]) < len(cont.history[0])


def test_packing_keeps_the_cache_to_the_longest_history_and_the_logits():
    # The rows share one write index, so each turn leaves padding in the rows with the shorter
    # chunk or action; packed before each prefill, the cache stays as long as the longest
    # history plus one turn (in cache buckets), far inside the context's bound, with no rebuild.
    short = _peaked(init_model(dataclasses.replace(CFG, max_position_embeddings=37), seed=3))
    opts = {**CONT_OPTS, "cache_bucket": 16}
    cont = Continuation(Sampler(short, **opts), slots=3, max_new_tokens=5, stop_token_ids=(STOP,))
    assert cont.max_cache_slots == 64  # 37 left-padded to 48 (prompt buckets), + 5, in 16s
    rng = np.random.default_rng(6)
    for slot in range(3):
        cont.start(slot, tokens(rng, int(rng.integers(2, 9))))
    for _ in range(8):
        before = {s: list(cont.history[s]) for s in range(3)}
        chunk = _round_up(max(len(p) for p in cont.pending), opts["prompt_bucket"])
        check_turn(short, cont, before, cont.turn())
        longest = max(len(h) for h in before.values())  # >= what the cache held before the turn
        assert cont.cache.size <= _round_up(longest + chunk + 5, 16)
        for slot in range(3):
            if len(cont.history[slot]) > 20:  # the episode ended: histories stay short
                cont.release(slot)
                cont.start(slot, tokens(rng, int(rng.integers(2, 9))))
            else:
                cont.append(slot, tokens(rng, int(rng.integers(1, 6))))
    assert cont.stats["packs"] >= 4 and cont.stats["rebuilds"] == 0


def test_threaded_continuation_takes_the_one_thread_actions(model):
    # 5 slots over 2 threads (slots 0-1 and 2-4), sampled at temperature 1: a part's keys from
    # a local slot, or a turn counter that stops while its part idles, would change actions.
    opts = {**CONT_OPTS, "batch_bucket": 2}
    kwargs = dict(max_new_tokens=7, temperature=1.0, stop_token_ids=(STOP,), seed=4)
    one = Continuation(Sampler(model, **opts, host_threads=1), 5, **kwargs)
    two = continuation(Sampler(model, **opts, host_threads=2), 5, **kwargs)
    assert isinstance(two, ThreadedContinuation) and len(two.parts) == 2
    rng = np.random.default_rng(8)
    def observe(slots):
        return [("append", s, tokens(rng, int(rng.integers(1, 6)))) for s in slots]

    script = [("start", s, tokens(rng, int(rng.integers(2, 12)))) for s in range(5)]
    script += [("turn",), ("release", 0), ("release", 1), *observe([2, 3, 4])]
    script += [("turn",), ("start", 0, tokens(rng, 4)), *observe([2, 3, 4])]  # part 0 idled
    script += [("turn",), *observe([0, 2, 3, 4]), ("turn",)]
    for cont in (one, two):
        cont.actions = []
        for op, *args in script:
            out = getattr(cont, op)(*args)
            if op == "turn":
                cont.actions.append(out)
    for a, b in zip(one.actions, two.actions, strict=True):
        assert a.keys() == b.keys() and a
        for slot in a:
            assert b[slot][0] == a[slot][0] and b[slot][2] == a[slot][2]
            np.testing.assert_allclose(b[slot][1], a[slot][1], rtol=1e-5, atol=1e-5)
    assert two.stats["prefill_tokens"] == one.stats["prefill_tokens"]
    with pytest.raises(ValueError, match="slot 1 has no episode"):
        two.append(1, [5])
    with pytest.raises(ValueError, match=r"slot 5 outside \[0, 5\)"):
        two.start(5, [5])


def test_misuse_is_named(model):
    cont = Continuation(Sampler(model, **CONT_OPTS), slots=2, max_new_tokens=4)
    assert cont.turn() == {}
    cont.start(0, [5, 6])
    with pytest.raises(ValueError, match="slot 0 is busy"):
        cont.start(0, [5])
    with pytest.raises(ValueError, match=r"slot 2 outside \[0, 2\)"):
        cont.start(2, [5])
    with pytest.raises(ValueError, match="slot 1 has no episode"):
        cont.append(1, [5])


def test_row_offset_samples_a_share_of_a_global_batch(model):
    """Process p of n generates its prompts with row_offset = its first global row: the same
    tokens and log-probs as those rows of one call over the whole batch (keys are per row)."""
    prompts = prompts_of([4, 7, 3, 6])
    kwargs = dict(num_samples=2, max_new_tokens=9, temperature=1.0, top_k=20, seed=7)
    whole = Sampler(model, **OPTS).generate(prompts, **kwargs)
    seen = []
    second = Sampler(model, **OPTS).generate(prompts[2:], row_offset=4, **kwargs,
                                             on_finish=lambda row, *_: seen.append(row))
    assert second.tokens == whole.tokens[4:]
    np.testing.assert_allclose(np.concatenate(second.logprobs), np.concatenate(whole.logprobs[4:]),
                               rtol=1e-5, atol=1e-6)  # another batch shape: float32 rounding
    assert sorted(seen) == [0, 1, 2, 3]  # reported rows count from 0
    unshifted = Sampler(model, **OPTS).generate(prompts[2:], **kwargs)
    assert unshifted.tokens != whole.tokens[4:]
