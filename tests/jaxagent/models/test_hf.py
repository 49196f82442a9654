"""Parity with `transformers` (PyTorch CPU) on tiny random checkpoints, and HF round trips.

Dimensions are distinct and odd where the architecture allows (head_dim must be even for RoPE),
so a transposed or mis-reshaped axis cannot pass.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxagent.config import ModelConfig, RopeScalingConfig
from jaxagent.models import CheckpointError, from_pretrained, init_model, save_pretrained
from rollouts.sampler import Sampler

VOCAB, B, T = 101, 3, 19

BASE = dict(vocab_size=VOCAB, hidden_size=66, intermediate_size=73, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
            initializer_range=0.15, max_position_embeddings=256)

CASES = {
    "llama-gqa-untied": ("Llama", dict(tie_word_embeddings=False)),
    "llama-mqa-bias-tied": ("Llama", dict(num_key_value_heads=1, attention_bias=True,
                                          tie_word_embeddings=True)),
    "llama3-rope-scaling": ("Llama", dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "llama-linear-rope": ("Llama", dict(rope_scaling=dict(rope_type="linear", factor=3.0))),
    "qwen2-bias-tied": ("Qwen2", dict(tie_word_embeddings=True)),
    "qwen2-mha-untied": ("Qwen2", dict(num_key_value_heads=6, tie_word_embeddings=False)),
    "qwen3-qknorm-untied": ("Qwen3", dict(tie_word_embeddings=False)),
    "qwen3-qknorm-bias-tied": ("Qwen3", dict(attention_bias=True, tie_word_embeddings=True,
                                             rope_theta=500000.0)),
}


def make_hf(name, path, seed=0):
    family, options = CASES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(**{**BASE, **options})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    model.save_pretrained(path)
    return model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.numpy()


def log_softmax(x):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(x, jnp.float32), axis=-1))


@pytest.fixture(params=sorted(CASES))
def case(request, tmp_path):
    return request.param, make_hf(request.param, tmp_path), tmp_path


def test_logits_match_transformers(case):
    name, hf, path = case
    ids = np.random.default_rng(1).integers(0, VOCAB, (B, T))
    ours = from_pretrained(path, dtype="float32")(jnp.asarray(ids))
    ref = hf_logits(hf, ids)
    assert ours.shape == (B, T, VOCAB)
    np.testing.assert_array_less(np.abs(log_softmax(ours) - log_softmax(ref)).max(), 1e-4)


def test_greedy_generation_matches_transformers(case):
    name, hf, path = case
    prompt = np.random.default_rng(2).integers(0, VOCAB, (1, 7))
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, 7:].tolist()
    sampler = Sampler(from_pretrained(path, dtype="float32"), prompt_bucket=8, cache_bucket=8,
                      segment_steps=5)
    out = sampler.generate(prompt.tolist(), max_new_tokens=20, temperature=0.0)
    assert out.tokens[0] == ref
    assert out.finish_reasons == ["length"]


def test_save_pretrained_round_trip_through_transformers(tmp_path):
    cfg = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=40, intermediate_size=67,
                      num_layers=3, num_heads=5, num_kv_heads=1, head_dim=10, qk_norm=False,
                      attention_bias=True, tie_embeddings=False, rms_norm_eps=1e-5,
                      rope_scaling=RopeScalingConfig("llama3", 4.0, 1.0, 4.0, 32))
    model = init_model(cfg, seed=3)
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    ids = np.random.default_rng(4).integers(0, VOCAB, (2, 11))
    ours = model(jnp.asarray(ids))
    np.testing.assert_array_less(np.abs(log_softmax(ours) - log_softmax(hf_logits(hf, ids))).max(), 1e-4)
    again = from_pretrained(tmp_path, dtype="float32")
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(ids))), np.asarray(ours))


def test_sharded_checkpoint_with_index(tmp_path):
    model = init_model(ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8), seed=5)
    save_pretrained(model, tmp_path, max_shard_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = np.random.default_rng(6).integers(0, VOCAB, (2, 9))
    loaded = from_pretrained(tmp_path, dtype="float32")
    np.testing.assert_allclose(np.asarray(loaded(jnp.asarray(ids))), hf_logits(hf, ids), atol=1e-4)


def test_bfloat16_load_is_close_to_float32(tmp_path):
    hf = make_hf("qwen3-qknorm-untied", tmp_path)
    ids = np.random.default_rng(7).integers(0, VOCAB, (B, T))
    model = from_pretrained(tmp_path)  # default dtype: bfloat16
    assert model.embed.dtype == jnp.bfloat16
    ours = model(jnp.asarray(ids))
    ref = hf_logits(hf, ids)
    diff = np.abs(log_softmax(ours) - log_softmax(ref))
    assert 0 < diff.max() < 0.25  # bf16 rounding, but no layout error
    assert (np.argmax(np.asarray(ours), -1) == ref.argmax(-1)).mean() > 0.9


def test_unsupported_architecture_is_named(tmp_path):
    make_hf("llama-gqa-untied", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: unsupported architecture 'GPT2LMHeadModel'"):
        from_pretrained(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    make_hf("qwen3-qknorm-untied", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.self_attn.k_norm.weight'"):
        from_pretrained(tmp_path)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"config.json: not found"):
        from_pretrained(tmp_path)
