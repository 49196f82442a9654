"""Training with LoRA: only the adapters train (the optimizer state holds them alone), the base
is untouched, the KL reference is the base under the reference adapters, and the sampler gets
the adapters merged into its own copy (or runs them unmerged) with the trainer's logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxagent.config import OptimizerConfig, load_config
from jaxagent.models import from_pretrained, init_model
from jaxagent.models.adapters import read_adapter_config, split_trainable, without_adapters
from jaxagent.models.config import LoraConfig, ModelConfig
from jaxagent.optim import make_optimizer
from jaxagent.steps import LossOptions, merged_model, pack, rl_step, sft_step
from jaxagent.train.build import load_model_and_tokenizer
from jaxagent.train.sync import SamplerWeights
from sharding.config import MeshConfig
from sharding.layout import Layout

LORA = LoraConfig(rank=3, alpha=6.0, targets=("*_proj", "embed_tokens"))
CFG = ModelConfig(vocab_size=61, hidden_size=24, intermediate_size=37, num_layers=2,
                  num_heads=3, num_kv_heads=1, head_dim=8, tie_embeddings=False, lora=LORA)
# the embedding and head trained whole beside the adapters
SAVED = LoraConfig(rank=3, alpha=6.0, targets=("*_proj",), modules_to_save=("embed_tokens",
                                                                           "lm_head"))


def rollouts(n=6, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 61, rng.integers(3, 9)).tolist() for _ in range(n)]
    completions = [rng.integers(0, 61, rng.integers(1, 7)).tolist() for _ in range(n)]
    logprobs = [(-rng.random(len(c))).tolist() for c in completions]
    return pack(prompts, completions, logprobs, rng.normal(size=n), bucket=8)


def setup(cfg=CFG):
    graphdef, weights = nnx.split(init_model(cfg, seed=0))
    params, frozen = split_trainable(weights)
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-2, max_grad_norm=0.0), 10)
    return graphdef, params, frozen, tx


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


@pytest.mark.parametrize("lora", [LORA, SAVED])
def test_only_the_adapters_train(lora):
    graphdef, params, frozen, tx = setup(dataclasses.replace(CFG, lora=lora))
    base = copy(frozen)
    opt_state = tx.init(params)
    sizes = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    assert sizes(opt_state) == 2 * sizes(params) + 2  # Adam: moments of the adapters, 2 counts
    saved = {p: x.size for p, x in nnx.to_flat_state(params) if p[-1] not in ("a", "b")}
    assert set(saved) == ({("embed",), ("lm_head",)} if lora.modules_to_save else set())
    assert sizes(params) - sum(saved.values()) < sizes(frozen) / 4
    before = copy(params)
    for _ in range(2):
        params, opt_state, metrics = sft_step(graphdef, tx, params, opt_state, rollouts(), 0, 0,
                                              frozen)
    assert all(np.abs(a - b).max() > 0 for a, b in zip(jax.tree.leaves(params),
                                                        jax.tree.leaves(before)))
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(base)):
        np.testing.assert_array_equal(a, b)


def test_kl_reference_is_the_base_under_the_reference_adapters():
    graphdef, params, frozen, tx = setup()
    ref = copy(params)  # B = 0: the reference is the base model itself
    options = LossOptions(kl_coef=0.5, entropy_coef=0.05)
    opt_state = tx.init(params)
    kls = []
    for _ in range(3):
        params, opt_state, metrics = rl_step(graphdef, tx, params, opt_state, rollouts(), ref,
                                             None, frozen, options=options)
        kls.append(float(metrics["train/kl"]))
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and kls[-1] > 1e-6  # moves off the base


def test_remat_over_a_frozen_base_and_reference_adapters():
    batch, options, norms = rollouts(), LossOptions(kl_coef=0.5), []
    for remat in ("none", "dots"):
        graphdef, params, frozen, tx = setup(dataclasses.replace(CFG, remat=remat))
        _, _, m = rl_step(graphdef, tx, copy(params), tx.init(params), batch, copy(params), None,
                          frozen, options=options)
        norms.append(m["train/grad_norm"])
    np.testing.assert_allclose(norms[1], norms[0], rtol=1e-5)


@pytest.mark.slow  # four compiled steps
def test_dropout_in_the_loss_pass_only():
    """A step's key drops the adapters' input in its loss pass; without a key the step is the
    one without dropout, and the KL reference never drops (at the first step, with the
    reference adapters equal to the policy's, the KL is exactly 0 without a key)."""
    batch, options = rollouts(), LossOptions(kl_coef=0.5)
    graphdef, params, frozen, tx = setup(dataclasses.replace(
        CFG, lora=dataclasses.replace(LORA, dropout=0.4)))
    plain, *_ = setup()
    randomised = jax.tree.map(lambda x: x + 0.2 * jax.random.normal(jax.random.key(7), x.shape),
                              params)  # nonzero B: dropout moves the loss pass's logits

    def step(g, key, micro=0):
        return rl_step(g, tx, copy(randomised), tx.init(params), batch, copy(randomised), None,
                       frozen, options=options, micro_batch=micro, dropout_key=key)

    none, _, m_none = step(graphdef, None)
    same, _, _ = step(plain, None)
    for a, b in zip(jax.tree.leaves(none), jax.tree.leaves(same)):
        np.testing.assert_array_equal(a, b)
    assert m_none["train/kl"] == pytest.approx(0.0, abs=1e-7)
    k1, _, m1 = step(graphdef, jax.random.key(1))
    again, _, _ = step(graphdef, jax.random.key(1))
    k2, _, _ = step(graphdef, jax.random.key(2))
    assert m1["train/kl"] > 1e-4  # the policy's pass dropped, the reference's not
    for a, b, c, d in zip(*map(jax.tree.leaves, (k1, again, k2, none))):
        np.testing.assert_array_equal(a, b)
        assert np.abs(a - c).max() > 0 and np.abs(a - d).max() > 0
    # each micro-batch draws its own masks: two micro-batches are not the whole batch's pass
    micro, _, _ = step(graphdef, jax.random.key(1), micro=3)
    assert any(np.abs(a - b).max() > 1e-6 for a, b in zip(*map(jax.tree.leaves, (micro, k1))))


@pytest.mark.parametrize("lora", [LORA, SAVED])
@pytest.mark.parametrize("mode", ["merged", "unmerged"])
def test_sampler_weights_give_the_trainers_logits(mode, lora):
    cfg = dataclasses.replace(CFG, lora=dataclasses.replace(lora, sampler=mode))
    graphdef, params, frozen, _ = setup(cfg)
    params = jax.tree.map(lambda x: x + 0.1, params)  # nonzero B
    layout = Layout(MeshConfig())
    to_sampler = SamplerWeights.create(cfg, layout, graphdef, frozen)
    store = to_sampler.store(params, None)
    store.publish(1, params)
    sampler_model = nnx.merge(to_sampler.graphdef, store.take(1))
    assert (sampler_model.config.lora.rank == 0) == (mode == "merged")
    tokens = rollouts().tokens
    trainer_model = merged_model(graphdef, params, frozen)
    np.testing.assert_allclose(sampler_model(tokens), trainer_model(tokens), atol=2e-5)


SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.intermediate_size=48",
         "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16", "sft.batch_size=8",
         "tasks.num_train=50", "tasks.num_eval=3", "rewards.workers=1", "model.lora.rank=4"]


@pytest.mark.parametrize("saved", [(), ("model.lora.modules_to_save=[embed_tokens]",)],
                         ids=["adapters", "saved_embedding"])
def test_sft_writes_peft_files_and_export_merges_them(tmp_path, saved):
    from jaxagent.cli import main

    small = [*SMALL, *saved]
    assert main(["sft", *small, "sft.steps=2", f"workdir={tmp_path}"]) == 0
    sft = tmp_path / "sft"  # a PEFT directory over the random base, written beside
    assert read_adapter_config(sft)[1] == str((sft / "base").absolute())
    assert main(["export", "--checkpoint", str(sft), "--out", str(tmp_path / "merged"),
                 "--merge", *small]) == 0
    adapted, _ = load_model_and_tokenizer(load_config(None, small), str(sft))
    assert adapted.config.lora.modules_to_save == (("embed_tokens",) if saved else ())
    full = from_pretrained(tmp_path / "merged", dtype="float32")
    assert not full.config.lora.rank
    tokens = rollouts().tokens
    np.testing.assert_allclose(full(tokens), adapted(tokens), atol=2e-5)
    assert np.abs(adapted(tokens) - without_adapters(adapted)(tokens)).max() > 1e-4  # trained
    untrained, _ = load_model_and_tokenizer(load_config(None, small))  # the seed's random init
    moved = np.abs(full.embed[...] - untrained.embed[...]).max()
    assert (moved > 1e-4) == bool(saved)  # the merged table is the trained one, when trained


def sharded_step(cfg, mesh):
    """One SFT step with base and adapters laid out by their logical axes over `mesh`, checked
    equal to the single-device one: (each sharded factor's first shard's shape, the single-device
    graphdef, factors before and after the step, frozen base, batch)."""
    layout = Layout(mesh)
    graphdef, weights = layout.split(init_model(cfg, seed=0))
    params, frozen = split_trainable(weights)
    shards = jax.tree.map(lambda x: x.addressable_shards[0].data.shape, params)
    ref_graphdef, ref_params, ref_frozen, tx = setup(cfg)
    before, batch = copy(ref_params), rollouts(8)
    new, _, m = sft_step(graphdef, tx, params, layout.place(tx.init(params)), layout.batch(batch),
                         0, 0, frozen)
    ref_new, _, ref_m = sft_step(ref_graphdef, tx, ref_params, tx.init(ref_params), batch, 0, 0,
                                 ref_frozen)
    np.testing.assert_allclose(m["sft/loss"], ref_m["sft/loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    return shards, ref_graphdef, before, ref_new, ref_frozen, batch


def test_sharded_lora_step_equals_the_single_device_one():
    shards = sharded_step(CFG, MeshConfig(data=2, fsdp=2, tensor=2))[0]
    # embed over fsdp, rank replicated
    assert shards["layers"][0]["attn"]["lora"]["q_proj"]["a"] == (12, 3)


MOE = dataclasses.replace(CFG, family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=11, lora=dataclasses.replace(LORA, targets=(
                              "q_proj", "gate_proj", "up_proj", "down_proj")))


@pytest.mark.slow  # three compiles of a MoE step
def test_expert_adapters_shard_over_experts_train_and_reach_the_sampler():
    """Expert adapters laid out over the expert mesh axis as the experts are; the sharded
    step equals the single-device one, trains them, and the merged sampler gives its logits."""
    shards, graphdef, before, new, frozen, batch = sharded_step(
        MOE, MeshConfig(data=2, expert=2, tensor=2))
    experts = shards["layers"][1]["mlp"]["lora"]
    assert experts["gate_up_proj"]["a"] == (2, 24, 6)  # experts over `expert`, 4 -> 2
    assert experts["down_proj"]["b"] == (2, 3, 1, 24)
    # every B trained, the experts' included (A's gradient is 0 while B is)
    moved = {p[:-1]: np.abs(v[...] - before_v[...]).max() > 0 for (p, v), (_, before_v) in zip(
        nnx.to_flat_state(new), nnx.to_flat_state(before)) if p[-1] == "b"}
    assert all(moved.values()) and ("layers", 1, "mlp", "lora", "gate_up_proj") in moved
    to_sampler = SamplerWeights.create(MOE, Layout(MeshConfig()), graphdef, frozen)
    store = to_sampler.store(new, None)
    store.publish(1, new)
    np.testing.assert_allclose(nnx.merge(to_sampler.graphdef, store.take(1))(batch.tokens),
                               merged_model(graphdef, new, frozen)(batch.tokens), atol=2e-5)
