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

from jaxagent.models import (
    CheckpointError,
    from_pretrained,
    init_model,
    save_pretrained,
)
from jaxagent.models.config import ModelConfig, RopeScalingConfig
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
    # HF's default grouped-mm experts need 16-byte strides (odd dims fail): the eager loop.
    # 5 experts top-2, renormalised, layer 1 dense through mlp_only_layers.
    "qwen3moe-norm-topk-dense-layer-untied": ("Qwen3Moe", dict(
        num_hidden_layers=3, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=23,
        mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=False,
        experts_implementation="eager")),
    # 7 experts top-3, raw softmax weights, only every second layer sparse.
    "qwen3moe-sparse-step-unnormalised-tied": ("Qwen3Moe", dict(
        num_hidden_layers=3, num_experts=7, num_experts_per_tok=3, moe_intermediate_size=19,
        decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True,
        experts_implementation="eager")),
    # Mixtral: every layer sparse, 5 experts top-2 of F = intermediate_size 73.
    "mixtral-untied": ("Mixtral", dict(num_local_experts=5, num_experts_per_tok=2,
                                       tie_word_embeddings=False, experts_implementation="eager")),
}


def make_hf(name, path, seed=0):
    family, options = CASES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(**{**BASE, **options})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # transformers starts biases at zero: a dropped one would pass unseen
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
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


# Greedy decoding through the sampler's KV cache, one case per decode path: RoPE scaling,
# attention biases, QK-norm, MoE layers (sparse and dense) with tied embeddings. The other cases
# differ only in what test_logits_match_transformers checks (layouts, GQA, ties): under -m slow.
GREEDY_DEFAULT = {"llama3-rope-scaling", "qwen2-bias-tied", "qwen3-qknorm-bias-tied",
                  "qwen3moe-sparse-step-unnormalised-tied"}


@pytest.mark.parametrize("case", [
    name if name in GREEDY_DEFAULT else pytest.param(name, marks=pytest.mark.slow)
    for name in sorted(CASES)], indirect=True)
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


@pytest.mark.parametrize("case, tensor", [
    ("qwen3-qknorm-untied", "model.layers.1.self_attn.k_norm.weight"),
    ("qwen3moe-norm-topk-dense-layer-untied", "model.layers.2.mlp.experts.3.up_proj.weight"),
])
def test_missing_tensor_is_named(tmp_path, case, tensor):
    from safetensors.numpy import load_file, save_file

    make_hf(case, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[tensor]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"missing tensor '{tensor}'"):
        from_pretrained(tmp_path)


def test_tensor_without_a_place_is_named(tmp_path):
    """A checkpoint tensor the model would ignore (a bias, a head it lacks) is an error, not a
    silently different model."""
    from safetensors.numpy import load_file, save_file

    make_hf("qwen3-qknorm-untied", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.bias"] = np.ones(BASE["hidden_size"], np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj.bias"):
        from_pretrained(tmp_path)


def test_missing_config_is_named(tmp_path):
    with pytest.raises(CheckpointError, match=r"config.json: not found"):
        from_pretrained(tmp_path)


MOE_EXPORTS = {
    "qwen3_moe": dict(mlp_only_layers=(0,), norm_topk_prob=False),
    "mixtral": dict(qk_norm=False),
}


@pytest.mark.parametrize("family", sorted(MOE_EXPORTS))
def test_moe_save_pretrained_round_trip_through_transformers(tmp_path, family):
    cfg = ModelConfig(family=family, vocab_size=VOCAB, hidden_size=42, intermediate_size=61,
                      num_layers=3, num_heads=3, num_kv_heads=1, head_dim=14, tie_embeddings=False,
                      num_experts=5, num_experts_per_tok=2, moe_intermediate_size=27,
                      **MOE_EXPORTS[family])
    model = init_model(cfg, seed=8)
    # Larger router weights than the init make the top-k choice matter.
    for layer in model.layers:
        if layer.sparse:
            layer.mlp.router[...] *= 20.0
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, experts_implementation="eager").eval()
    assert hf.config.model_type == family and hf.config.num_local_experts == 5
    ids = np.random.default_rng(9).integers(0, VOCAB, (2, 13))
    ours = model(jnp.asarray(ids))
    np.testing.assert_array_less(np.abs(log_softmax(ours) - log_softmax(hf_logits(hf, ids))).max(), 1e-4)
    again = from_pretrained(tmp_path, dtype="float32")
    moe_fields = ("family", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef")
    assert all(getattr(again.config, f) == getattr(cfg, f) for f in moe_fields)
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(ids))), np.asarray(ours))


@pytest.mark.parametrize("case", ["qwen3moe-norm-topk-dense-layer-untied", "mixtral-untied"])
def test_moe_fused_expert_layout_loads(tmp_path, case):
    """transformers >= 5 keeps experts fused in memory ([E, 2F, D] gate|up, [E, D, F] down)."""
    from safetensors.numpy import save_file

    hf = make_hf(case, tmp_path / "per_expert")
    fused = {k: v.contiguous().numpy() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    (tmp_path / "fused" / "config.json").write_text((tmp_path / "per_expert" / "config.json").read_text())
    ids = np.random.default_rng(10).integers(0, VOCAB, (B, T))
    ours = from_pretrained(tmp_path / "fused", dtype="float32")(jnp.asarray(ids))
    np.testing.assert_array_less(np.abs(log_softmax(ours) - log_softmax(hf_logits(hf, ids))).max(), 1e-4)


def test_moe_missing_expert_count_is_named(tmp_path):
    make_hf("qwen3moe-norm-topk-dense-layer-untied", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("num_local_experts", None)
    config.pop("num_experts", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: missing field 'num_experts'"):
        from_pretrained(tmp_path)


def test_experts_cannot_be_exported_as_a_dense_family(tmp_path):
    from flax import nnx

    from jaxagent.models import Decoder

    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8, num_experts=3,
                      moe_intermediate_size=8)
    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # the config is what fails
    with pytest.raises(CheckpointError, match=r"model.num_experts=3 cannot be exported as family 'qwen3'"):
        save_pretrained(model, tmp_path)
