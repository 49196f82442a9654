"""The sampler on its own mesh: weights resharded from the trainer's mesh, same samples; across
processes, the publish is one program on the devices (2 local processes, gloo)."""

import collections
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from rollouts.sampler import Sampler
from sharding.config import MeshConfig
from sharding.layout import Layout, process_devices
from sharding.rules import shardings

MODEL = ModelConfig(vocab_size=72, hidden_size=24, intermediate_size=40, num_layers=2,
                    num_heads=6, num_kv_heads=2, head_dim=10, bos_token_id=None,
                    eos_token_id=None, pad_token_id=None)


@pytest.mark.slow  # two samplers compile: ~20 s quiet, ~2 min on the shared cores
def test_sampler_mesh_gets_resharded_weights_and_samples_the_same():
    layout = Layout(MeshConfig(data=1, fsdp=8), MeshConfig(data=4, tensor=2))
    assert dict(layout.sampler_mesh.shape) == {"data": 4, "fsdp": 1, "expert": 1, "tensor": 2}
    reference = init_model(MODEL, seed=2)
    graphdef, params = layout.split(init_model(MODEL, seed=2))
    wq = params["layers"][0]["attn"]["wq"].get_value()
    assert wq.addressable_shards[0].data.shape == (3, 6, 10)  # fsdp 8 on embed

    model = layout.sampler_model(graphdef, params)
    sampled = nnx.state(model, nnx.Param)
    for got, want in zip(jax.tree.leaves(sampled),
                         jax.tree.leaves(shardings(sampled, layout.sampler_mesh, layout.rules))):
        assert got.sharding.is_equivalent_to(want, got.ndim)
    wq = sampled["layers"][0]["attn"]["wq"].get_value()
    assert wq.addressable_shards[0].data.shape == (24, 3, 10)  # tensor 2 on heads

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 72, n).tolist() for n in (5, 9, 3)]
    kw = {"max_new_tokens": 6, "temperature": 0.0, "num_samples": 2}
    ours = Sampler(model, prompt_bucket=16, cache_bucket=32,
                   activations=layout.sampler_activations).generate(prompts, **kw)
    ref = Sampler(reference, prompt_bucket=16, cache_bucket=32).generate(prompts, **kw)
    assert ours.tokens == ref.tokens
    for a, b in zip(ours.logprobs, ref.logprobs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_host_copy_brings_sharded_weights_to_host_memory_whole():
    from jax.sharding import NamedSharding, PartitionSpec

    layout = Layout(MeshConfig(data=1, fsdp=4, tensor=2))
    rng = np.random.default_rng(0)
    values = {"w": rng.normal(size=(12, 6)).astype(np.float32), "b": np.arange(5.0)}
    specs = {"w": PartitionSpec("fsdp", "tensor"), "b": PartitionSpec()}
    weights = {k: jax.device_put(v, NamedSharding(layout.mesh, specs[k]))
               for k, v in values.items()}
    host = layout.host_copy(weights)
    for k, v in values.items():
        assert isinstance(host[k], np.ndarray)
        np.testing.assert_array_equal(host[k], v)


def test_sampler_params_are_the_trainers_on_the_samplers_layout():
    layout = Layout(MeshConfig(data=1, fsdp=4, tensor=2), MeshConfig(data=2, expert=2, tensor=2))
    _, params = layout.split(init_model(MODEL, seed=4))
    expected = [np.asarray(x) for x in jax.tree.leaves(params)]
    ours = layout.sampler_params(params)
    for x in jax.tree.leaves(params):
        x.delete()  # what the train step's donation does: the sampler's copy is its own
    ruled = shardings(ours, layout.sampler_mesh, layout.rules)
    for got, want, value in zip(*map(jax.tree.leaves, (ours, ruled)), expected):
        assert got.sharding.is_equivalent_to(want, got.ndim)
        assert all(s.data.shape == got.sharding.shard_shape(got.shape)
                   for s in got.addressable_shards)
        np.testing.assert_array_equal(np.asarray(got), value)


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two processes start, join and compile: ~30 s on the shared cores
def test_publish_across_processes_moves_each_device_its_sampler_blocks(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_FLAGS"))},
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        ["bash", str(ROOT / "launch/local_multihost.sh"), "--logdir", str(tmp_path), "2", "4",
         "--", sys.executable, str(Path(__file__).parent / "publish_probe.py")],
        check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "process 0 of 2: ok" in out.stdout
    assert "process 1 of 2: ok" in (tmp_path / "process_1.log").read_text()


def test_every_process_needs_as_many_devices():
    """Each process's sampler mesh takes its own devices, and a publish lays the weights out on
    all of them side by side: unequal counts are a config error naming them, not numpy's."""
    from jaxagent.errors import ConfigError

    fake = collections.namedtuple("Fake", "id process_index")
    even = [fake(i, i // 4) for i in range(8)]
    assert [[d.id for d in g] for g in process_devices(even)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ConfigError, match=r"sampler.mesh: the processes have unequal device "
                                          r"counts \(process 0: 5, process 1: 3\)"):
        process_devices([fake(i, int(i >= 5)) for i in range(8)])


def test_spanning_layout_samples_on_a_mesh_over_every_device():
    """`jaxagent eval` / `generate`: the sampler's mesh over all devices (all processes'),
    `sampler.mesh` when given; one that cannot fill them is an error naming it."""
    from jaxagent.errors import ConfigError

    trainer = MeshConfig(data=2, fsdp=4)
    assert Layout(trainer, spanning=True).sampler_mesh.shape == {
        "data": 2, "fsdp": 4, "expert": 1, "tensor": 1}
    own = Layout(trainer, MeshConfig(data=-1, tensor=2), spanning=True).sampler_mesh
    assert own.shape == {"data": 4, "fsdp": 1, "expert": 1, "tensor": 2}
    assert set(own.devices.flat) == set(jax.devices())
    with pytest.raises(ConfigError, match=r"sampler.mesh: sampler.mesh.data=3, .* makes 3 "
                                          r"devices, but there are 8"):
        Layout(trainer, MeshConfig(data=3), spanning=True)


def test_random_init_on_a_mesh_makes_each_device_its_blocks():
    """`init_model(..., shardings=)` (what a run without `init_from` does on a mesh): the same
    weights as the unsharded init, each laid out by the rules from the start."""
    cfg = ModelConfig(vocab_size=96, hidden_size=40, intermediate_size=72, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=10)
    layout = Layout(MeshConfig(fsdp=4, tensor=2))
    on_mesh = lambda w: shardings(w, layout.mesh, layout.rules)  # noqa: E731
    model = init_model(cfg, seed=3, shardings=on_mesh)
    flat = [nnx.to_flat_state(tree) for tree in (nnx.state(model), nnx.state(init_model(cfg, seed=3)),
                                                 on_mesh(nnx.state(model)))]
    for (path, got), (_, want), (_, where) in zip(*flat, strict=True):
        got = got.get_value()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.get_value()), err_msg=str(path))
        assert got.sharding.is_equivalent_to(where.get_value(), got.ndim), path
    wq = model.layers[0].attn.wq.get_value()
    assert {s.data.shape for s in wq.addressable_shards} == {(10, 2, 10)}  # embed over fsdp 4, heads over tensor 2
