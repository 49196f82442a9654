import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxagent.models import document_layout, init_model
from jaxagent.models.config import DocumentConfig, ModelConfig
from rollouts.kv_store import KVStore
from rollouts.sampler import Sampler

CFG = ModelConfig(vocab_size=73, hidden_size=38, intermediate_size=51, num_layers=3, num_heads=6,
                  num_kv_heads=3, head_dim=14, tie_embeddings=False)
OPTS = dict(prompt_bucket=8, cache_bucket=16, batch_bucket=4, segment_steps=5)


def make_model(cfg):
    # Larger weights than the default init give peaked, token-varied distributions.
    m = init_model(cfg, seed=1)
    state = nnx.state(m, nnx.Param)
    nnx.update(m, jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, state))
    return m


@pytest.fixture(scope="module")
def model():
    return make_model(CFG)


def random_tokens(rng, lengths):
    return [rng.integers(0, CFG.vocab_size, n).tolist() for n in lengths]


def packed_logprobs(model, docs, final):
    """log-softmax [len(final), V] of ONE forward of [docs..., final] (no cache), laid out by
    document_layout: the reference for the cached path."""
    seg, pos = document_layout([len(d) for d in docs], len(final), model.config.documents)
    tokens = sum(docs, []) + final
    n = len(tokens)
    assert n <= PAD_TO
    pad = [0] * (PAD_TO - n)  # right padding (segment 0): unseen, and one compile per model
    logits = _forward(model, jnp.asarray([tokens + pad]), jnp.asarray([list(pos) + pad]),
                      jnp.asarray([list(seg) + pad]))
    return np.asarray(jax.nn.log_softmax(logits[0, n - len(final):n], axis=-1))


PAD_TO = 64


@nnx.jit
def _forward(model, tokens, positions, segment_ids):
    return model(tokens, positions, segment_ids)


@pytest.mark.parametrize("attention,documents", [
    ("dense", DocumentConfig(final_positions="sum")),
    ("dense", DocumentConfig(final_positions="longest")),
    ("dense", DocumentConfig(restart_positions=False)),
    # The Pallas kernel in interpret mode (slow on CPU); it equals the dense model elsewhere.
    pytest.param("doc", DocumentConfig(final_positions="longest"), marks=pytest.mark.slow),
])
def test_assembled_prompt_matches_one_packed_forward(model, attention, documents):
    cfg = dataclasses.replace(CFG, attention=attention, documents=documents)
    m = nnx.merge(nnx.graphdef(make_model(cfg)), nnx.state(model))
    rng = np.random.default_rng()
    # Uneven documents, a single document, and a repeated one, in rows of different widths.
    shared = random_tokens(rng, [6])[0]
    docs = [random_tokens(rng, [7, 2, 13]) + [shared], random_tokens(rng, [5]), [shared]]
    prompts = random_tokens(rng, [4, 9, 1])
    sampler = Sampler(m, **OPTS)
    logits, _, _, stats = sampler._prefill_documents(prompts, docs)
    # Without restarting positions, a document's KV depends on where it lands: no reuse.
    reused = int(documents.restart_positions)
    assert (stats["kv_store"]["hits"], stats["kv_store"]["misses"]) == (reused, 6 - reused)
    for r in range(len(prompts)):
        np.testing.assert_allclose(jax.nn.log_softmax(logits[r]),
                                   packed_logprobs(m, docs[r], prompts[r])[-1], atol=1e-5)
    # Sampled tokens' log-probs through decoding equal the packed forward's (the completion
    # continues the final section).
    out = sampler.generate(prompts, documents=docs, max_new_tokens=6, seed=5)
    for r, tokens in enumerate(out.tokens):
        ref = packed_logprobs(m, docs[r], prompts[r] + tokens)
        ref = ref[len(prompts[r]) - 1:-1][np.arange(len(tokens)), tokens]
        np.testing.assert_allclose(out.logprobs[r], ref, atol=1e-5)


@pytest.mark.slow  # the log-prob equality above covers the same path
def test_greedy_with_documents_equals_full_prefill_reference(model):
    rng = np.random.default_rng()
    docs, prompt = random_tokens(rng, [9, 4, 17]), random_tokens(rng, [5])[0]
    generated = []
    for _ in range(6):
        generated.append(int(packed_logprobs(model, docs, prompt + generated)[-1].argmax()))
    for sharing in (True, False):
        out = Sampler(model, **OPTS, prefix_sharing=sharing).generate(
            [prompt], documents=[docs], num_samples=2, max_new_tokens=6, temperature=0)
        assert out.tokens == [generated, generated]


def test_cache_hit_runs_no_model_call_for_that_document(model):
    rng = np.random.default_rng()
    docs, prompt = random_tokens(rng, [5, 8, 3, 11]), random_tokens(rng, [6])[0]
    sampler = Sampler(model, **OPTS)
    encoded = []
    encode = sampler._encode_documents
    sampler._encode_documents = lambda items: encoded.append(items) or encode(items)

    first = sampler.generate([prompt], documents=[docs], max_new_tokens=4, temperature=0)
    assert [len(t) for t, _ in encoded[0]] == [5, 8, 3, 11]
    assert first.stats["kv_store"]["model_calls"] == 1
    assert first.stats["kv_store"]["tokens_encoded"] == 27

    again = sampler.generate([prompt], documents=[docs], max_new_tokens=4, temperature=0)
    assert len(encoded) == 1  # no model call
    s = again.stats["kv_store"]
    assert (s["hits"], s["misses"], s["tokens_encoded"], s["tokens_saved"]) == (4, 0, 0, 27)
    assert s["hit_rate"] == 1.0 and again.tokens == first.tokens
    assert again.stats["prefill_tokens"] == 6  # the prompt only

    half_new = docs[:2] + random_tokens(rng, [7, 2])
    out = sampler.generate([prompt], documents=[half_new], max_new_tokens=4, temperature=0)
    assert [t for t, _ in encoded[1]] == half_new[2:]  # only the new ones, in one call
    s = out.stats["kv_store"]
    assert (s["hits"], s["misses"], s["tokens_encoded"], s["tokens_saved"]) == (2, 2, 9, 13)
    assert s["hit_rate"] == 0.5 and sampler.kv_store.stats["model_calls"] == 2

    # New weights invalidate every stored KV.
    sampler.update_weights(model)
    assert len(sampler.kv_store) == 0
    out = sampler.generate([prompt], documents=[docs], max_new_tokens=4, temperature=0)
    assert out.stats["kv_store"]["misses"] == 4 and len(encoded) == 3


def test_lru_spills_to_host_and_returns_identical_kv():
    rng = np.random.default_rng()
    entries = {f"k{i}": jnp.asarray(rng.standard_normal((3, 2, 2, 5, 6)), jnp.float32)
               for i in range(4)}
    size = entries["k0"].nbytes
    store = KVStore(device_bytes=2 * size, host_bytes=size)
    for key, kv in entries.items():
        store.put(key, kv)
    # Two on the device (the newest), one spilled to the host, the oldest spilled then dropped.
    assert store.device_used == 2 * size and store.host_used == size
    assert store.stats["evictions"] == 2 and store.stats["dropped"] == 1
    assert "k0" not in store and store.get("k0") is None
    back = store.get("k1")  # from the host, back on the device; k2 spills
    assert isinstance(back, jax.Array)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(entries["k1"]))
    assert store.stats["host_hits"] == 1 and store.stats["evictions"] == 3
    np.testing.assert_array_equal(np.asarray(store.get("k3")), np.asarray(entries["k3"]))
    assert store.stats["device_hits"] == 1


def test_spilled_documents_give_the_same_generation(model):
    rng = np.random.default_rng()
    docs, prompt = random_tokens(rng, [6, 10, 4]), random_tokens(rng, [3])[0]
    one_doc = 3 * 2 * CFG.num_kv_heads * 10 * CFG.head_dim * 4  # the largest entry, fp32
    sampler = Sampler(model, **OPTS, kv_store=KVStore(device_bytes=one_doc))
    first = sampler.generate([prompt], documents=[docs], max_new_tokens=5, seed=2)
    assert sampler.kv_store.stats["evictions"] == 2
    again = sampler.generate([prompt], documents=[docs], max_new_tokens=5, seed=2)
    s = again.stats["kv_store"]
    assert s["hits"] == 3 and s["host_hits"] >= 2 and s["model_calls"] == 0
    assert again.tokens == first.tokens
    np.testing.assert_array_equal(again.logprobs[0], first.logprobs[0])


@pytest.mark.parametrize("documents,message", [
    ([[[1, 2]]], r"documents: one list of documents per prompt, got 1 lists for 2 prompts"),
    ([[[1, 2]], [[3], []]], r"documents\[1\]\[1\]: empty document"),
    ([[[1, 2]], [[3, 99]]], r"documents\[1\]\[0\]: token id 99 outside vocab"),
])
def test_bad_documents_are_named(model, documents, message):
    with pytest.raises(ValueError, match=message):
        Sampler(model, **OPTS).generate([[1], [2]], documents=documents, max_new_tokens=2)
