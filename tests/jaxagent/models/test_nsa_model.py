"""The decoder with `model.attention: nsa`: parameters, training steps, and decoding that
matches the teacher-forced forward (the sampler's left-padded KV-cache path)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxagent.config import OptimizerConfig
from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig, NSAConfig
from jaxagent.models.llama import logical_axes
from jaxagent.optim import make_optimizer
from jaxagent.steps import pack, sft_step
from rollouts.sampler import Sampler

# Small blocks so that a 40-token sequence exercises all three branches.
CFG = dataclasses.replace(
    ModelConfig(num_layers=2, hidden_size=48, intermediate_size=96, num_heads=6, num_kv_heads=2, head_dim=8),
    attention="nsa",
    nsa=NSAConfig(compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=6),
)


def test_nsa_parameters_carry_logical_axes():
    axes = logical_axes(init_model(CFG))
    names = {k[-1] if isinstance(k[-1], str) else k for k in axes}
    nsa = {k: v for k, v in axes.items() if "nsa" in k}
    assert len(nsa) == 2 * (2 * 3 + 1)  # per layer: pos, w1, w2 for keys and values; gates
    assert nsa[("layers", 0, "attn", "nsa", "gate")] == ("heads", "head_dim", "nsa_branch")
    assert nsa[("layers", 1, "attn", "nsa", "compress_k", "w1")] == ("nsa_block", "head_dim", "nsa_hidden")
    assert "wq" in names
    with pytest.raises(ValueError, match="model.nsa"):
        init_model(dataclasses.replace(CFG, nsa=NSAConfig(compress_block=10, compress_stride=4)))


def test_kernels_config_runs_the_pallas_branches():
    """`model.nsa.kernels: all` (the three Pallas kernels, interpreted on CPU) gives the plain-XLA
    model's logits: the wiring hands the kernels q, k, v in their layout."""
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 200, (2, 37)), jnp.int32)
    xla = init_model(CFG, seed=4)
    kernels = init_model(dataclasses.replace(CFG, nsa=dataclasses.replace(CFG.nsa, kernels="all")), seed=4)
    forward = lambda m, t: m(t)
    assert "pallas_call" not in str(jax.make_jaxpr(forward)(xla, tokens))
    # per layer: selected, window, compressed attention and block scoring
    assert str(jax.make_jaxpr(forward)(kernels, tokens)).count("pallas_call") == 2 * 4
    want = jax.jit(forward)(xla, tokens)
    np.testing.assert_allclose(jax.jit(forward)(kernels, tokens), want, atol=2e-4, rtol=2e-4)


@pytest.mark.slow
def test_nsa_model_differs_from_dense_and_trains():
    model = init_model(CFG, seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 200, (2, 40)), jnp.int32)
    dense = nnx.merge(*nnx.split(init_model(dataclasses.replace(CFG, attention="dense"), seed=0)))
    assert not np.allclose(model(tokens), dense(tokens), atol=1e-3)
    graphdef, params = nnx.split(model)
    w1_before = jnp.copy(params["layers"][0]["attn"]["nsa"]["compress_k"]["w1"].get_value())
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2, max_grad_norm=0.0), 10)
    opt_state = tx.init(params)
    rng = np.random.default_rng(1)
    batch = pack([rng.integers(0, 60, 20).tolist() for _ in range(4)], [rng.integers(0, 60, 15).tolist() for _ in range(4)])
    losses = []
    for _ in range(4):
        params, opt_state, m = sft_step(graphdef, tx, params, opt_state, batch)
        losses.append(float(m["sft/loss"]))
    assert losses[-1] < losses[0] - 0.1
    w1_after = params["layers"][0]["attn"]["nsa"]["compress_k"]["w1"].get_value()
    assert float(jnp.abs(w1_after - w1_before).max()) > 0  # the compression MLP is trained


@pytest.mark.slow  # test_decode_steps_match_teacher_forced_layer runs by default
def test_sampler_decoding_matches_teacher_forced_forward():
    """Greedy NSA decoding over a left-padded KV cache picks the teacher-forced argmax at every
    step, with the same log-probabilities (prompts of different lengths: different pads)."""
    model = init_model(CFG, seed=3)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 200, 13).tolist(), rng.integers(0, 200, 22).tolist()]
    sampler = Sampler(model, prompt_bucket=16, cache_bucket=16, segment_steps=8)
    out = sampler.generate(prompts, max_new_tokens=20, temperature=0.0)
    for prompt, gen, logp in zip(prompts, out.tokens, out.logprobs):
        seq = jnp.asarray([prompt + gen], jnp.int32)
        logits = model(seq)[0, len(prompt) - 1 : -1]
        np.testing.assert_array_equal(np.argmax(logits, -1), gen)
        want = jax.nn.log_softmax(logits)[jnp.arange(len(gen)), jnp.asarray(gen)]
        np.testing.assert_allclose(logp, want, atol=2e-4)
