"""Multi-turn continuation: prefilling only the appended tokens onto the kept KV cache gives the
same logits as prefilling the whole history; slots are refilled; the cache is rebuilt."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxagent.config import ModelConfig
from jaxagent.models import init_model
from rollouts.sampler import Continuation, Sampler

CFG = ModelConfig(vocab_size=67, hidden_size=36, intermediate_size=53, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=10, tie_embeddings=False)
# One cache size and one chunk length, so each jitted function compiles once.
OPTS = {"prompt_bucket": 16, "cache_bucket": 256, "batch_bucket": 4, "segment_steps": 6}
PAD_TO = 192  # reference forwards are right-padded to one length (causal: the padding is unseen)
STOP = 3


@pytest.fixture(scope="module")
def model():
    m = init_model(CFG, seed=1)
    state = nnx.state(m, nnx.Param)
    nnx.update(m, jax.tree.map(lambda x: x * 6.0 if x.ndim > 1 else x, state))
    return m


@nnx.jit
def forward(model, tokens):
    return model(tokens)


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
    cont = Continuation(Sampler(model, **OPTS), slots=3, max_new_tokens=13, stop_token_ids=(STOP,),
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


def test_released_slots_are_refilled_and_rebuilds_keep_the_logits(model):
    rng = np.random.default_rng(1)
    cont = Continuation(Sampler(model, **OPTS), slots=2, max_new_tokens=7, stop_token_ids=(STOP,),
                        max_cache_slots=64)
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


def test_misuse_is_named(model):
    cont = Continuation(Sampler(model, **OPTS), slots=2, max_new_tokens=4)
    assert cont.turn() == {}
    cont.start(0, [5, 6])
    with pytest.raises(ValueError, match="slot 0 is busy"):
        cont.start(0, [5])
    with pytest.raises(ValueError, match=r"slot 2 outside \[0, 2\)"):
        cont.start(2, [5])
    with pytest.raises(ValueError, match="slot 1 has no episode"):
        cont.append(1, [5])
