"""LoRA adapters: the math (merged = unmerged, zero B = base), config errors, and parity with
`peft` + transformers on tiny random models, both ways (we write -> peft reads, peft writes ->
we read). Dimensions are odd and distinct so a transposed factor cannot pass."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from jaxagent.errors import ConfigError
from jaxagent.models import from_pretrained, init_model
from jaxagent.models.adapters import (init_adapters, load_adapter, merged, read_adapter_config, save_adapter,
                                      split_adapters, with_adapters, without_adapters)
from jaxagent.models.config import LoraConfig, ModelConfig
from jaxagent.models.hf import CheckpointError
from jaxagent.models.llama import Decoder
from jaxagent.models.lora import Adapter, ExpertLoraParam, LoraParam, lora_targets

VOCAB = 97
TINY = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=30, intermediate_size=43,
                   num_layers=2, num_heads=3, num_kv_heads=1, head_dim=10, qk_norm=False,
                   tie_embeddings=False)
EVERYTHING = LoraConfig(rank=5, alpha=7.0, targets=("*_proj", "embed_tokens", "lm_head"))


def randomise_b(model, seed=0):
    """Nonzero B (and embedding A) factors: a fresh adapter is the identity."""
    nnx.update(model, _perturbed(split_adapters(model)[1], jax.random.key(seed)))
    return model


@jax.jit  # one program: eager, each factor's shape would compile its own
def _perturbed(factors, key):
    keys = iter(jax.random.split(key, 64))
    return jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), factors)


def ids(shape=(2, 11), seed=1):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape))


def test_fresh_adapters_start_at_the_base_and_merge_exactly():
    model = init_model(dataclasses.replace(TINY, lora=EVERYTHING), seed=3)
    base = merged(model)
    assert not nnx.state(base, LoraParam)
    np.testing.assert_allclose(model(ids()), base(ids()), atol=1e-6)  # B = 0
    randomise_b(model)
    adapted = model(ids())
    assert np.abs(adapted - base(ids())).max() > 1e-2
    np.testing.assert_allclose(merged(model)(ids()), adapted, atol=2e-5)


@pytest.mark.parametrize("tied, saved", [(True, ("embed_tokens",)),
                                         (False, ("embed_tokens", "lm_head"))])
def test_modules_to_save_train_whole_and_merge(tied, saved, tmp_path):
    """A saved module trains beside the factors (not in the frozen base), starts at the base's
    weight, and replaces it on merge and in the forward pass."""
    base = init_model(dataclasses.replace(TINY, tie_embeddings=tied), seed=4)
    lora = LoraConfig(rank=3, targets=("q_proj",), modules_to_save=saved)
    cfg = dataclasses.replace(base.config, lora=lora)
    model = with_adapters(base, lora, init_adapters(cfg, seed=5))
    _, factors, frozen = split_adapters(model)
    paths = {p[0] for p, _ in nnx.to_flat_state(factors) if len(p) == 1}
    assert paths == {{"embed_tokens": "embed", "lm_head": "lm_head"}[n] for n in saved}
    assert not {p for p, _ in nnx.to_flat_state(frozen) if p[0] in paths}
    np.testing.assert_allclose(model(ids()), base(ids()), atol=1e-6)
    key = jax.random.key(6)
    for path in paths:  # train the saved weights: the model, its merge and a plain decoder agree
        w = getattr(model, path)
        w.set_value(w[...] + 0.3 * jax.random.normal(key, w.shape))
    plain = nnx.clone(base)
    for path in paths:
        getattr(plain, path).set_value(getattr(model, path)[...])
    expected = plain(ids())
    assert np.abs(expected - base(ids())).max() > 1e-2
    np.testing.assert_allclose(model(ids()), expected, atol=1e-6)
    np.testing.assert_allclose(merged(model)(ids()), expected, atol=1e-6)
    save_adapter(model, tmp_path)
    np.testing.assert_allclose(load_adapter(base, tmp_path)(ids()), expected, atol=1e-6)
    if tied:  # peft without weight tying trains the table's copy under the base's head
        config = json.loads((tmp_path / "adapter_config.json").read_text())
        (tmp_path / "adapter_config.json").write_text(json.dumps({**config,
                                                                  "ensure_weight_tying": False}))
        with pytest.raises(CheckpointError, match="needs ensure_weight_tying: true"):
            load_adapter(base, tmp_path)


def test_only_targeted_weights_have_adapters():
    cfg = dataclasses.replace(TINY, lora=LoraConfig(rank=4, targets=("q_proj", "v_proj")))
    _, factors, _ = split_adapters(init_model(cfg))
    paths = {p[:-1] for p, _ in nnx.to_flat_state(factors)}
    assert paths == {("layers", i, "attn", "lora", name) for i in (0, 1)
                     for name in ("q_proj", "v_proj")}


@pytest.mark.parametrize("lora, tied, message", [
    (LoraConfig(rank=-1), False, "model.lora.rank: must be >= 0"),
    (LoraConfig(rank=4, alpha=0.0), False, "model.lora.alpha: must be > 0"),
    (LoraConfig(rank=4, dropout=1.0), False, r"model.lora.dropout: must be in \[0, 1\)"),
    (LoraConfig(rank=4, targets=("q_proj", "wq")), False, r"model.lora.targets: \['wq'\]"),
    (LoraConfig(rank=4, targets=("lm_head",)), True, "lm_head needs model.tie_embeddings"),
    (LoraConfig(rank=4, modules_to_save=("lm_head",)), True, "model.lora.modules_to_save"),
    (LoraConfig(rank=4, modules_to_save=("q_proj",)), False, "model.lora.modules_to_save"),
    (LoraConfig(rank=4, targets=("embed_tokens",), modules_to_save=("embed_tokens",)), False,
     "model.lora.modules_to_save: \\['embed_tokens'\\] also adapted"),
    (LoraConfig(modules_to_save=("embed_tokens",)), False, "needs model.lora.rank > 0"),
])
def test_bad_config_names_the_field(lora, tied, message):
    with pytest.raises(ConfigError, match=message):
        init_model(dataclasses.replace(TINY, lora=lora, tie_embeddings=tied))


DROPOUT = dataclasses.replace(EVERYTHING, dropout=0.3)


@nnx.jit
def forward(model, tokens, key=None):
    return model(tokens, dropout_key=key)


@pytest.mark.slow  # six compiles
def test_dropout_acts_on_a_training_pass_only():
    model = randomise_b(init_model(dataclasses.replace(TINY, lora=DROPOUT), seed=3))
    plain = with_adapters(model, EVERYTHING, split_adapters(model)[1])  # same factors, p = 0
    tokens, key = ids(), jax.random.key(5)
    np.testing.assert_array_equal(forward(model, tokens), forward(plain, tokens))  # eval, sampler
    np.testing.assert_array_equal(forward(plain, tokens, key), forward(plain, tokens))  # p = 0
    train = forward(model, tokens, key)
    np.testing.assert_array_equal(forward(model, tokens, key), train)  # the key decides
    assert np.abs(train - forward(model, tokens, jax.random.key(6))).max() > 1e-3
    assert np.abs(train - forward(model, tokens)).max() > 1e-3
    # Only the adapters' input is dropped: with B = 0 the base's path is untouched.
    fresh = init_model(dataclasses.replace(TINY, lora=dataclasses.replace(DROPOUT,
                                                                          targets=("*_proj",))))
    np.testing.assert_array_equal(forward(fresh, tokens, key), forward(fresh, tokens))


def test_dropout_keeps_the_adapters_mean_output():
    """Inverted dropout: over masks, E[s (m x / (1 - p)) A B] = s x A B (float64 reference),
    and a kept entry is scaled by exactly 1 / (1 - p)."""
    rngs, p = nnx.Rngs(0), 0.3
    adapter = Adapter(dataclasses.replace(DROPOUT, rank=5, dropout=p), ((13, "embed"),),
                      ((3, "heads"), (7, "head_dim")), rngs=rngs)
    adapter.b.set_value(jax.random.normal(jax.random.key(1), adapter.b.shape))
    x = jax.random.normal(jax.random.key(2), (4, 13))
    a, b = np.asarray(adapter.a[...], np.float64), np.asarray(adapter.b[...], np.float64)
    expected = adapter.scale * np.einsum("nd,dr,rhk->nhk", np.asarray(x, np.float64), a, b)
    np.testing.assert_allclose(adapter(x), expected, rtol=1e-5, atol=1e-5)
    samples = jax.vmap(lambda k: adapter(x, k))(jax.random.split(jax.random.key(3), 4000))
    spread = np.asarray(samples, np.float64).std(0) / np.sqrt(4000)
    assert (np.abs(np.asarray(samples, np.float64).mean(0) - expected) < 5 * spread + 1e-6).all()
    # One draw, by its mask: kept inputs scaled by 1 / (1 - p), dropped ones zero.
    key = jax.random.key(4)
    keep = np.asarray(jax.random.bernoulli(key, 1 - p, x.shape), np.float64)
    dropped = np.asarray(x, np.float64) * keep / (1 - p)
    np.testing.assert_allclose(adapter(x, key), adapter.scale * np.einsum(
        "nd,dr,rhk->nhk", dropped, a, b), rtol=1e-5, atol=1e-5)


def test_moe_adapts_attention_dense_mlp_layers_and_experts():
    cfg = ModelConfig(family="qwen3_moe", vocab_size=VOCAB, hidden_size=30, intermediate_size=43,
                      num_layers=2, num_heads=3, num_kv_heads=1, head_dim=10, num_experts=3,
                      moe_intermediate_size=11, mlp_only_layers=(0,),
                      lora=LoraConfig(rank=3, targets=("*_proj",)))
    model = randomise_b(init_model(cfg))
    _, factors, _ = split_adapters(model)
    owners = {p[:5] for p, _ in nnx.to_flat_state(factors) if p[2] == "mlp"}
    assert owners == {("layers", 0, "mlp", "lora", n) for n in ("gate_proj", "up_proj", "down_proj")
                      } | {("layers", 1, "mlp", "lora", n) for n in ("gate_up_proj", "down_proj")}
    np.testing.assert_allclose(forward(merged(model), ids()), forward(model, ids()), atol=2e-5)


MIXTRAL = ModelConfig(family="mixtral", vocab_size=VOCAB, hidden_size=30, num_layers=2,
                      num_heads=3, num_kv_heads=1, head_dim=10, num_experts=3,
                      moe_intermediate_size=11)


@pytest.mark.parametrize("lora, message", [
    (LoraConfig(rank=3, targets=("q_proj", "gate_proj")),
     r"model.lora.targets: \['gate_proj'\] adapts one of gate_proj and up_proj"),
    (LoraConfig(rank=3, dropout=0.1), r"model.lora.dropout: 0.1 with MoE expert adapters"),
])
def test_what_moe_experts_cannot_take_is_a_config_error(lora, message):
    with pytest.raises(ConfigError, match=message):
        nnx.eval_shape(lambda: Decoder(dataclasses.replace(MIXTRAL, lora=lora), rngs=nnx.Rngs(0)))
    # a model without sparse layers takes either
    nnx.eval_shape(lambda: Decoder(dataclasses.replace(TINY, lora=lora), rngs=nnx.Rngs(0)))


# ---------------------------------------------------------------------------------------------
# Parity with peft + transformers.

HF_BASE = dict(vocab_size=VOCAB, hidden_size=30, intermediate_size=43, num_hidden_layers=2,
               num_attention_heads=3, num_key_value_heads=1, head_dim=10, rms_norm_eps=1e-5,
               initializer_range=0.15, max_position_embeddings=64)
FAMILIES = {
    "llama": ("Llama", dict(tie_word_embeddings=False),
              dict(targets=("*_proj", "embed_tokens", "lm_head"), dropout=0.1)),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True),
              dict(targets=("q_proj", "v_proj", "o_proj", "down_proj", "embed_tokens"),
                   dropout=0.05)),
    "qwen3": ("Qwen3", dict(tie_word_embeddings=False), dict(targets=("*_proj",), rslora=True)),
    # the embedding (a tied model's head with it) and an untied head trained whole
    "qwen2_saved": ("Qwen2", dict(tie_word_embeddings=True),
                    dict(targets=("q_proj",), modules_to_save=("embed_tokens",))),
    "qwen3_saved": ("Qwen3", dict(tie_word_embeddings=False),
                    dict(targets=("v_proj",), modules_to_save=("embed_tokens", "lm_head"))),
    # attention only with a dense layer: peft maps gate/up/down_proj onto the experts alone
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=3, num_experts_per_tok=2, moe_intermediate_size=11,
                                   mlp_only_layers=[0], experts_implementation="eager"),
                  dict(targets=("q_proj", "k_proj", "v_proj", "o_proj"))),
    # every layer sparse: attention and every expert's gate-up (rank 2r) and down adapters
    "qwen3_moe_experts": ("Qwen3Moe", dict(num_experts=7, num_experts_per_tok=2,
                                           moe_intermediate_size=13,
                                           experts_implementation="eager"),
                          dict(targets=("*_proj",), rslora=True)),
    "mixtral_experts": ("Mixtral", dict(num_local_experts=7, num_experts_per_tok=3,
                                        intermediate_size=13, experts_implementation="eager"),
                        dict(targets=("q_proj", "gate_proj", "up_proj", "down_proj"))),
}
# peft's names for the experts' projections: Qwen3-MoE's are ours, Mixtral's w1, w3, w2
PEFT_NAMES = {"mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}}


@pytest.fixture(params=[pytest.param(f, marks=pytest.mark.slow) if f == "mixtral_experts" else f
                        for f in sorted(FAMILIES)])  # one experts family by default
def family(request, tmp_path):
    arch, options, lora = FAMILIES[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(**{**HF_BASE, **options})
    hf = getattr(transformers, f"{arch}ForCausalLM")(config).eval()
    hf.save_pretrained(tmp_path / "base")
    return hf, tmp_path, LoraConfig(rank=5, alpha=11.0, **lora)


def peft_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def test_peft_reads_what_we_write(family):
    hf, tmp, lora = family
    base = from_pretrained(tmp / "base", dtype="float32")
    ours = with_adapters(base, lora, split_adapters(init_model(
        dataclasses.replace(base.config, lora=lora), seed=1))[1])
    randomise_b(ours, seed=2)
    save_adapter(ours, tmp / "adapter", base_model=str(tmp / "base"))
    theirs = peft.PeftModel.from_pretrained(hf, tmp / "adapter").eval()
    assert theirs.peft_config["default"].lora_dropout == lora.dropout
    tokens = ids()
    np.testing.assert_allclose(forward(ours, tokens), peft_logits(theirs, tokens), atol=1e-4)
    assert np.abs(forward(ours, tokens) - forward(base, tokens)).max() > 1e-2  # the adapters matter
    experts = nnx.state(ours, ExpertLoraParam)
    if experts:  # and the experts' among them
        nnx.update(ours, jax.tree.map(jnp.zeros_like, experts))
        assert np.abs(forward(ours, tokens) - peft_logits(theirs, tokens)).max() > 1e-2


def test_we_read_what_peft_writes(family):
    hf, tmp, lora = family
    names = PEFT_NAMES.get(hf.config.model_type, {})
    targets = sorted(names.get(t, t) for t in lora_targets(lora))
    theirs = peft.get_peft_model(hf, peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, use_rslora=lora.rslora, target_modules=targets,
        lora_dropout=lora.dropout, init_lora_weights=False,  # random nonzero B
        modules_to_save=list(lora.modules_to_save) or None,
        ensure_weight_tying=bool(lora.modules_to_save) and hf.config.tie_word_embeddings))
    with torch.no_grad():  # trained saved modules: their copies leave the base's
        for name, w in theirs.named_parameters():
            if "modules_to_save" in name:
                w.add_(0.3 * torch.randn_like(w))
    theirs.eval().save_pretrained(tmp / "adapter")
    ours = load_adapter(from_pretrained(tmp / "base", dtype="float32"), tmp / "adapter")
    read = read_adapter_config(tmp / "adapter")[0]
    assert read == dataclasses.replace(lora, targets=tuple(sorted(lora_targets(lora))))
    tokens = ids()
    np.testing.assert_allclose(ours(tokens), peft_logits(theirs, tokens), atol=1e-4)


def test_unsupported_adapter_config_is_named(tmp_path):
    model = randomise_b(init_model(dataclasses.replace(TINY, lora=EVERYTHING)))
    save_adapter(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(CheckpointError, match=r"adapter_config.json: use_dora=True"):
        load_adapter(without_adapters(model), tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config,
                                                              "rank_pattern": {"q_proj": 8}}))
    with pytest.raises(CheckpointError, match=r"rank_pattern=\{'q_proj': 8\} is not supported"):
        load_adapter(without_adapters(model), tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    with pytest.raises(CheckpointError, match=r"adapter_model.safetensors: tensor .* has shape"):
        load_adapter(without_adapters(model), tmp_path)


def test_round_trip_through_our_files(tmp_path):
    model = randomise_b(init_model(dataclasses.replace(TINY, lora=EVERYTHING)))
    save_adapter(model, tmp_path)
    again = load_adapter(without_adapters(model), tmp_path)
    np.testing.assert_array_equal(again(ids()), model(ids()))
