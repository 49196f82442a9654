"""Loading HF checkpoints straight onto a mesh (8 fake CPU devices): the same weights as a whole
load, each laid out as the trainer places it, and no device block read bigger than its shard.

Dimensions are distinct; each sharded one divides its mesh axes (fsdp 2, expert 2, tensor 2),
so every layout conversion (transpose, head split, expert stack, fused slice) is read in parts.
"""

import math

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jaxagent.models import from_pretrained, hf, save_pretrained
from sharding.config import DEFAULT_AXIS_RULES, MeshConfig
from sharding.mesh import build_mesh
from sharding.rules import shardings

# vocab_size: at least the byte tokenizer's (the trainer loads it beside the model)
BASE = dict(vocab_size=262, hidden_size=66, intermediate_size=74, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, head_dim=10, rms_norm_eps=1e-5,
            initializer_range=0.15, max_position_embeddings=64)
CASES = {
    "qwen2-bias-untied": ("Qwen2", dict(tie_word_embeddings=False)),  # q/k/v biases
    "qwen3moe-dense-layer": ("Qwen3Moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=22, mlp_only_layers=[1],
        tie_word_embeddings=True, experts_implementation="eager")),
}
MESH = MeshConfig(data=1, fsdp=2, expert=2, tensor=2)


def make_hf(name, path):
    family, options = CASES[name]
    torch.manual_seed(11)
    config = getattr(transformers, f"{family}Config")(**{**BASE, **options})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    model.save_pretrained(path)
    return model


def fuse_experts(model, path):
    """The checkpoint as transformers >= 5 holds it in memory: experts fused per layer."""
    tensors = {k: v.contiguous().numpy() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    path.mkdir()
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name in CASES:
        path = tmp_path_factory.mktemp(name)
        model = make_hf(name, path / "hf")
        out[name] = path / "hf"
        if "moe" in name:
            fused = fuse_experts(model, path / "fused")
            (fused / "config.json").write_text((path / "hf" / "config.json").read_text())
            out[name + "-fused"] = fused
    return out


def params(model):
    return dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))


class Reads:
    """Wraps the checkpoint files' tensors (the real memory maps) and records every block read."""

    def __init__(self, monkeypatch):
        self.blocks: dict[str, list[tuple[int, ...]]] = {}
        real = hf._mapped_tensors
        reads = self

        class Recorded:
            def __init__(self, name, tensor):
                self.name, self.tensor, self.shape = name, tensor, tensor.shape

            def __getitem__(self, index):
                block = self.tensor[index]
                reads.blocks.setdefault(self.name, []).append(block.shape)
                return block

        monkeypatch.setattr(hf, "_mapped_tensors", lambda file: {
            name: Recorded(name, tensor) for name, tensor in real(file).items()})


@pytest.mark.parametrize("name", ["qwen2-bias-untied", "qwen3moe-dense-layer",
                                  "qwen3moe-dense-layer-fused"])
def test_sharded_load_equals_whole_load_with_the_trainers_layout(checkpoints, name, monkeypatch):
    path = checkpoints[name]
    mesh = build_mesh(MESH)
    whole = from_pretrained(path, dtype="float32")
    reads = Reads(monkeypatch)
    sharded = from_pretrained(path, dtype="float32", mesh=mesh, rules=DEFAULT_AXIS_RULES)
    # The trainer's layout of these weights (`Layout.place`).
    expected = dict(nnx.to_flat_state(shardings(nnx.state(whole, nnx.Param), mesh,
                                                DEFAULT_AXIS_RULES)))
    ours = params(sharded)
    for path_, var in params(whole).items():
        x = ours[path_].get_value()
        assert x.sharding == expected[path_].get_value(), path_
        np.testing.assert_array_equal(np.asarray(x), np.asarray(var.get_value()),
                                      err_msg=str(path_))
        shard = x.sharding.shard_shape(x.shape)
        assert all(s.data.shape == shard for s in x.addressable_shards), path_
    # The layouts that matter are sharded, not replicated.
    attn = ours[("layers", 0, "attn", "wq")].get_value()
    assert attn.sharding.spec == P("fsdp", "tensor", None)
    if "moe" in name:
        assert ours[("layers", 0, "mlp", "w_gate")].get_value().sharding.spec == P(
            "expert", "fsdp", "tensor")
    # No read is bigger than the shard of the parameter it feeds.
    shard_size = {tensor: math.prod(x.sharding.shard_shape(x.shape))
                  for m in hf._tensor_map(sharded.config, fused_experts="fused" in name)
                  for x in [ours[m.path].get_value()] for tensor in m.hf_names}
    for tensor, blocks in reads.blocks.items():
        assert max(math.prod(b) for b in blocks) <= shard_size[tensor], tensor
    embed = reads.blocks["model.embed_tokens.weight"]
    # 8 devices, 4 distinct blocks (replicated over the expert axis): one read each
    assert set(embed) == {(131, 33)} and len(embed) == 4


def test_bfloat16_checkpoint_loads_exactly_whole_and_sharded(tmp_path):
    """Released checkpoints are bfloat16 (which safetensors' numpy reader cannot read)."""
    model = make_hf("qwen2-bias-untied", tmp_path / "f32").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    torch_weights = {k: v.float().numpy() for k, v in model.state_dict().items()}
    whole = params(from_pretrained(tmp_path / "bf16"))
    sharded = params(from_pretrained(tmp_path / "bf16", mesh=build_mesh(MESH),
                                     rules=DEFAULT_AXIS_RULES))
    for p, var in whole.items():
        assert sharded[p].get_value().dtype == np.dtype("bfloat16")
        np.testing.assert_array_equal(np.asarray(sharded[p].get_value()),
                                      np.asarray(var.get_value()), err_msg=str(p))
    d, k, h = BASE["hidden_size"], BASE["num_key_value_heads"], BASE["head_dim"]
    np.testing.assert_array_equal(np.asarray(whole[("embed",)].get_value(), np.float32),
                                  torch_weights["model.embed_tokens.weight"])
    np.testing.assert_array_equal(
        np.asarray(whole[("layers", 1, "attn", "wk")].get_value(), np.float32),
        torch_weights["model.layers.1.self_attn.k_proj.weight"].T.reshape(d, k, h))


@pytest.mark.parametrize("name", sorted(CASES))
def test_sharded_model_saves_the_checkpoint_it_loaded(checkpoints, name, tmp_path):
    path = checkpoints[name]
    model = from_pretrained(path, dtype="float32", mesh=build_mesh(MESH), rules=DEFAULT_AXIS_RULES)
    save_pretrained(model, tmp_path)
    before, after = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert sorted(after) == sorted(before)
    for tensor, value in before.items():
        np.testing.assert_array_equal(after[tensor], value, err_msg=tensor)


def test_mesh_without_rules_is_refused(checkpoints):
    with pytest.raises(ValueError, match="mesh and rules together"):
        from_pretrained(checkpoints["qwen2-bias-untied"], mesh=build_mesh(MESH))


def test_not_a_safetensors_file_is_named(checkpoints, tmp_path):
    (tmp_path / "config.json").write_text(
        (checkpoints["qwen2-bias-untied"] / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(hf.CheckpointError, match=r"model.safetensors: not a safetensors file"):
        from_pretrained(tmp_path)


def test_wrong_tensor_shape_is_named(checkpoints, tmp_path):
    tensors = load_file(checkpoints["qwen2-bias-untied"] / "model.safetensors")
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(
        (checkpoints["qwen2-bias-untied"] / "config.json").read_text())
    with pytest.raises(hf.CheckpointError, match=rf"tensor '{name}' has shape \(19, 66\), which "
                                                 r"does not convert to the shape \(66, 2, 10\)"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize("name", sorted(CASES))
def test_trainer_loads_onto_its_mesh_under_fresh_adapters(checkpoints, name):
    """`load_model_and_tokenizer` with the run's layout: base weights on the mesh as placed,
    LoRA adapters (and experts) on top, every weight as the whole load's."""
    from jaxagent.config import load_config
    from jaxagent.models.adapters import split_adapters
    from jaxagent.train.build import load_model_and_tokenizer
    from sharding.layout import Layout

    cfg = load_config(None, [f"init_from={checkpoints[name]}", "model.lora.rank=3",
                             "model.param_dtype=float32", "model.dtype=float32"])
    layout = Layout(MESH)
    whole, _ = load_model_and_tokenizer(cfg)
    sharded, _ = load_model_and_tokenizer(cfg, layout=layout)
    _, factors, base = split_adapters(sharded)
    assert len(jax.tree.leaves(factors)) > 0
    placed = dict(nnx.to_flat_state(shardings(base, layout.mesh, layout.rules)))
    for p, var in nnx.to_flat_state(base):
        assert var.get_value().sharding == placed[p].get_value(), p
    expected = dict(nnx.to_flat_state(nnx.state(whole)))
    for p, var in nnx.to_flat_state(nnx.state(sharded)):
        np.testing.assert_array_equal(np.asarray(var.get_value()),
                                      np.asarray(expected[p].get_value()), err_msg=str(p))
