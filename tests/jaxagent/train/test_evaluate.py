"""`generate`, `eval`, `agent` and `export` load a checkpoint straight onto the sampler's mesh
(8 fake CPU devices): every weight laid out as the rules say, the same weights and samples as
a whole load on one device."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxagent.config import load_config
from jaxagent.models import init_model, save_pretrained
from jaxagent.models.config import ModelConfig
from jaxagent.train.build import load_model_and_tokenizer, make_sampler, sampling_layout
from jaxagent.train.evaluate import load_policy
from sharding.rules import shardings

# Distinct dimensions; heads, kv heads, experts, the vocabulary and the model dimension divide
# the mesh axes that split them, so every kind of weight is sharded.
MOE = ModelConfig(family="qwen3_moe", vocab_size=262, hidden_size=66, intermediate_size=74,
                  num_layers=2, num_heads=6, num_kv_heads=2, head_dim=10, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=22, mlp_only_layers=(1,),
                  tie_embeddings=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_pretrained(init_model(MOE, seed=5), tmp_path_factory.mktemp("moe") / "hf")


def flat(model):
    return dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("mesh", [["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
                                  ["sampler.mesh.expert=4", "sampler.mesh.tensor=2"]])
def test_policy_loads_onto_the_samplers_mesh_as_the_rules_say(checkpoint, mesh):
    cfg = load_config(None, [*mesh, "model.param_dtype=float32", "model.dtype=float32"])
    layout = sampling_layout(cfg)
    assert len(layout.sampler_mesh.devices.flat) == 8
    model, _, _ = load_policy(cfg, str(checkpoint), layout)
    whole, _ = load_model_and_tokenizer(cfg, str(checkpoint))
    ours = flat(model)
    ruled = dict(nnx.to_flat_state(shardings(nnx.state(model, nnx.Param), layout.sampler_mesh,
                                             layout.rules)))
    for path, var in flat(whole).items():
        x = ours[path].get_value()
        assert x.sharding == ruled[path].get_value(), path
        assert all(s.data.shape == x.sharding.shard_shape(x.shape)
                   for s in x.addressable_shards), path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(var.get_value()),
                                      err_msg=str(path))
    # the layouts that matter are sharded: experts over `expert`, heads over `tensor`
    w_gate = ours[("layers", 0, "mlp", "w_gate")].get_value()
    assert w_gate.sharding.shard_shape(w_gate.shape)[0] < 4
    wq = ours[("layers", 0, "attn", "wq")].get_value()
    assert wq.sharding.shard_shape(wq.shape)[1] < 6
    assert jax.tree.leaves(whole)[0].sharding.device_set == {jax.devices()[0]}


@pytest.mark.slow  # two samplers compile: ~7 s on the shared cores
def test_policy_on_the_samplers_mesh_samples_like_a_whole_load(checkpoint):
    cfg = load_config(None, ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2",
                             "model.param_dtype=float32", "model.dtype=float32"])
    layout = sampling_layout(cfg)
    model, tokenizer, _ = load_policy(cfg, str(checkpoint), layout)
    whole, _ = load_model_and_tokenizer(cfg, str(checkpoint))
    prompts = [[5, 9, 17, 33, 2], [7, 1, 40]]
    kw = {"num_samples": 2, "max_new_tokens": 5, "temperature": 0.0}
    got = make_sampler(model, tokenizer, cfg, layout.sampler_activations).generate(prompts, **kw)
    want = make_sampler(whole, tokenizer, cfg).generate(prompts, **kw)
    assert got.tokens == want.tokens
    for a, b in zip(got.logprobs, want.logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
