import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from jaxagent.models import Decoder, KVCache, init_model, logical_axes
from jaxagent.models.config import ModelConfig, RopeScalingConfig
from jaxagent.models.llama import rope_frequencies
from pallas_kernels.attention import dense_attention, resolve_backend
from pallas_kernels.doc_attention import visible

CFG = ModelConfig(vocab_size=83, hidden_size=45, intermediate_size=71, num_layers=2, num_heads=6,
                  num_kv_heads=3, head_dim=14, attention_bias=True, qk_norm=True,
                  tie_embeddings=False)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=0)


@nnx.jit
def forward(model, tokens, positions=None, segment_ids=None, cache=None):
    return model(tokens, positions, segment_ids, cache)


def test_every_parameter_has_logical_axes_of_its_rank(model):
    axes = logical_axes(model)
    state = {path: var[...] for path, var in nnx.to_flat_state(nnx.state(model))}
    assert set(axes) == set(state)
    for path, names in axes.items():
        assert len(names) == state[path].ndim, path
        assert set(names) <= {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp"}
    assert axes[("layers", 1, "attn", "wq")] == ("embed", "heads", "head_dim")


def test_llama3_rope_frequencies_match_transformers():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    hf = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32, rope_scaling=dict(scaling),
                     rope_theta=50000.0)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = rope_frequencies(dataclasses.replace(
        CFG, head_dim=32, rope_theta=50000.0, rope_scaling=RopeScalingConfig(**scaling)))
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    # And the scaling really changes something at these settings.
    plain = rope_frequencies(dataclasses.replace(CFG, head_dim=32, rope_theta=50000.0))
    assert np.abs(plain - ours).max() > 1e-3


@pytest.mark.parametrize("t", [5, 1])  # t=1 takes the decode path
def test_xla_attention_matches_float64_reference(t):
    rng = np.random.default_rng(t)
    b, s, n, k, h = 9, 7, 6, 2, 3
    q, kk, v = (rng.standard_normal(shape) for shape in [(b, t, n, h), (b, k, s, h), (b, k, s, h)])
    # Negative query segments ("sees all") see every positive segment as well as their own.
    q_seg = rng.integers(-2, 3, (b, t)); kv_seg = rng.integers(-2, 3, (b, s))
    q_slots = np.sort(rng.integers(0, s, (b, t))); kv_slots = np.tile(np.arange(s), (b, 1))
    out = dense_attention(*(jnp.asarray(x, jnp.float32) for x in (q, kk, v)),
                          q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_slots=q_slots,
                          kv_slots=kv_slots, backend="xla", rows="cached")  # T != S: a cache
    ref = np.zeros((b, t, n, h))
    for bi in range(b):
        for ti in range(t):
            for ni in range(n):
                ki = ni // (n // k)
                qs, ks = q_seg[bi, ti], kv_seg[bi]
                ok = ((ks == qs) | ((qs < 0) & (ks > 0))) & (ks != 0) & (kv_slots[bi] <= q_slots[bi, ti])
                if not ok.any():
                    continue
                scores = kk[bi, ki] @ q[bi, ti, ni] / np.sqrt(h)
                scores = np.where(ok, scores, -np.inf)
                p = np.exp(scores - scores.max()); p /= p.sum()
                ref[bi, ti, ni] = p @ v[bi, ki]
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)
    mask = visible(q_seg, kv_seg, q_slots, kv_slots)
    assert mask.shape == (b, t, s)
    assert not np.asarray(mask).any(-1).all()  # a query that sees nothing is covered


def test_packed_sequences_equal_separate_runs(model):
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 83, 9), rng.integers(0, 83, 6)
    packed = jnp.asarray(np.concatenate([a, b, [0, 0]])[None])
    segment_ids = jnp.asarray([[1] * 9 + [2] * 6 + [0, 0]])
    positions = jnp.asarray([list(range(9)) + list(range(6)) + [0, 0]])
    out = forward(model, packed, positions, segment_ids)
    np.testing.assert_allclose(out[0, :9], forward(model, jnp.asarray(a[None]))[0], atol=1e-5)
    np.testing.assert_allclose(out[0, 9:15], forward(model, jnp.asarray(b[None]))[0], atol=1e-5)


def test_incremental_decoding_with_cache_equals_full_forward(model):
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 83, (3, 13)))
    full = forward(model, tokens)
    cache = KVCache.empty(CFG, 3, 16)
    logits, cache = forward(model, tokens[:, :8], cache=cache)  # prefill 8
    chunks = [logits]
    for t in range(8, 13):  # then one token at a time
        positions = jnp.full((3, 1), t)
        logits, cache = forward(model, tokens[:, t:t + 1], positions, cache=cache)
        chunks.append(logits)
    np.testing.assert_allclose(jnp.concatenate(chunks, 1), full, atol=1e-5)
    assert int(cache.index) == 13
    assert np.asarray(cache.segment_ids)[:, 13:].sum() == 0


def test_document_kernel_over_a_cache_equals_xla(model):
    """`attention_backend: pallas` (the kernel, interpreted here; `auto`'s prefill on a GPU)
    through a cache: a left-padded prefill, then decode steps, give the XLA model's logits."""
    kernel = nnx.merge(nnx.graphdef(init_model(dataclasses.replace(CFG, attention_backend="pallas"))),
                       nnx.state(model))
    tokens = jnp.asarray(np.random.default_rng(5).integers(1, 83, (3, 11)))
    segment_ids = jnp.asarray(np.arange(9)[None] >= np.array([[0], [4], [7]]), jnp.int32)
    positions = jnp.maximum(jnp.cumsum(segment_ids, 1) - 1, 0)
    logits = {}
    for name, m in (("xla", model), ("pallas", kernel)):
        cache = KVCache.empty(CFG, 3, 16)
        out, cache = forward(m, tokens[:, :9], positions, segment_ids, cache)
        chunks = [out]
        for t in range(9, 11):
            step_pos = positions[:, -1:] + t - 8
            out, cache = forward(m, tokens[:, t:t + 1], step_pos, jnp.ones((3, 1), jnp.int32), cache)
            chunks.append(out)
        logits[name] = jnp.concatenate(chunks, 1)
    real = np.asarray(segment_ids.astype(bool))  # padded queries' logits are not used
    real = np.concatenate([real, np.ones((3, 2), bool)], 1)
    np.testing.assert_allclose(np.asarray(logits["pallas"])[real], np.asarray(logits["xla"])[real],
                               atol=2e-5)


def test_unknown_attention_backend_is_named():
    with pytest.raises(ValueError, match="model.attention_backend: unknown backend 'nope'"):
        init_model(dataclasses.replace(CFG, attention_backend="nope"))


def test_attention_backend_is_picked_per_kind():
    """On CPU `model.attention_backend: auto` is XLA for dense attention and the Pallas kernel
    for document attention; an explicit backend wins for both (every platform and row layout:
    tests/pallas_kernels/test_attention.py)."""
    assert [resolve_backend(kind) for kind in ("dense", "doc")] == ["xla", "pallas"]
    assert [resolve_backend(kind, "xla") for kind in ("dense", "doc")] == ["xla", "xla"]
    assert [resolve_backend(kind, "pallas") for kind in ("dense", "doc")] == ["pallas", "pallas"]
    with pytest.raises(ValueError, match="attention 'nsa' has no backend option"):
        resolve_backend("nsa")  # NSA picks its kernels itself (model.nsa.kernels)


ON_CPU = pytest.mark.skipif(jax.default_backend() != "cpu", reason="splash interpreted, no cudnn: CPU")


def _splash_and_xla_models():
    dense = init_model(CFG, seed=1)
    splash = nnx.merge(nnx.graphdef(init_model(dataclasses.replace(CFG, attention_backend="splash"))),
                       nnx.state(dense))
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 83, (3, 29)))
    segment_ids = jnp.asarray(np.arange(29)[None, :] < np.array([[29], [17], [5]]), jnp.int32)
    run = nnx.jit(lambda m, rows: m(tokens, None, segment_ids, rows=rows), static_argnames="rows")
    return splash, dense, run


@ON_CPU
@pytest.mark.slow  # the interpreted kernel in both layers: 6-12 s here
def test_splash_backend_model_equals_xla_on_causal_rows():
    """`attention_backend: splash` (interpreted here) on right-padded rows the caller declares
    causal gives the XLA model's logits."""
    splash, dense, run = _splash_and_xla_models()
    np.testing.assert_allclose(run(splash, "causal"), run(dense, "causal"), atol=2e-5)


@ON_CPU
def test_backend_errors_name_the_option():
    """Rows a backend cannot run (any segment ids: the model's default) and a backend this
    platform lacks are errors naming `model.attention_backend`."""
    splash, _, run = _splash_and_xla_models()
    with pytest.raises(ValueError, match="model.attention_backend: splash runs causal rows only"):
        run(splash, "segments")
    with pytest.raises(ValueError, match="model.attention_backend: cudnn runs on gpu, not cpu"):
        init_model(dataclasses.replace(CFG, attention_backend="cudnn"))


def test_heads_must_divide():
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of model.num_kv_heads \(4\)"):
        init_model(dataclasses.replace(CFG, num_kv_heads=4))


def test_bfloat16_params_and_compute():
    cfg = dataclasses.replace(CFG, param_dtype="bfloat16", dtype="bfloat16")
    m = init_model(cfg)
    assert m.layers[0].attn.wq.dtype == jnp.bfloat16
    out = forward(m, jnp.zeros((1, 4), jnp.int32))
    assert out.dtype == jnp.float32 and bool(jnp.isfinite(out).all())


def test_document_kernel_backend_equals_dense_model():
    """`attention_backend: pallas` (the kernel, interpreted here) on a document-level row:
    two documents restarting their positions, then a final section that reads both."""
    dense = init_model(CFG, seed=1)
    doc = nnx.merge(nnx.graphdef(init_model(dataclasses.replace(CFG, attention_backend="pallas"))),
                    nnx.state(dense))
    rng = np.random.default_rng(2)
    tokens = jnp.asarray(rng.integers(0, 83, (1, 23)))
    segment_ids = jnp.asarray([[1] * 9 + [2] * 8 + [-1] * 5 + [0]])
    positions = jnp.asarray([list(range(9)) + list(range(8)) + list(range(9, 14)) + [0]])
    want = forward(dense, tokens, positions, segment_ids)
    np.testing.assert_allclose(forward(doc, tokens, positions, segment_ids), want, atol=2e-5)
    # A document's logits do not depend on the other document.
    alone = forward(dense, tokens[:, 9:17], positions[:, 9:17], jnp.ones((1, 8), jnp.int32))
    np.testing.assert_allclose(want[:, 9:17], alone, atol=2e-5)


def test_remat_keeps_what_its_policy_says_and_the_same_gradient():
    # The list behind jax.ad_checkpoint.print_saved_residuals (public only as that print).
    from jax._src.ad_checkpoint import saved_residuals

    tokens = jnp.asarray(np.random.default_rng(3).integers(0, CFG.vocab_size, (3, 29)))
    b, t, d = 3, 29, CFG.hidden_size
    saved, grads = {}, {}
    params = nnx.state(init_model(CFG, seed=0))
    for remat in ("none", "dots", "full"):
        cfg = dataclasses.replace(CFG, remat=remat)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
        loss = lambda p: jnp.sum(jnp.sin(nnx.merge(graphdef, p)(tokens)))  # noqa: E731
        # Activations kept for the backward pass (parameters are arguments, not activations).
        saved[remat] = [a.shape for a, why in saved_residuals(loss, params)
                        if not why.startswith("from the argument") and len(a.shape) >= 3]
        grads[remat] = jax.jit(jax.grad(loss))(params)
    assert any(s[-2:] == (t, t) for s in saved["none"])  # attention probabilities
    assert not any(s[-2:] == (t, t) for s in saved["dots"] + saved["full"])
    # dots: the weights' matmul outputs; full: each layer's input only (and, outside the
    # layers, the final norm's and the logits').
    assert (b, t, CFG.intermediate_size) in saved["dots"]
    assert set(saved["full"]) <= {(b, t, d), (b, t, 1), (1, 1, d), (b, t, CFG.vocab_size)}
    assert saved["full"].count((b, t, d)) <= CFG.num_layers + 3  # + the final norm's in, out
    for remat in ("dots", "full"):
        for a, g in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[remat])):
            np.testing.assert_allclose(g, a, rtol=1e-5, atol=1e-6)
