"""Run under launch/local_multihost.sh (2 processes x 4 CPU devices): a publish to the sampler
across processes. The trainer's mesh (fsdp 4 x tensor 2) spans both processes; each process's
sampler mesh (data 2 x tensor 2, the default) spans its own devices. The published copy must be
this process's whole copy, in the compute dtype, laid out on its sampler mesh by the rules, with
the trainer's values; the program that moves it must give no device more than its blocks."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxagent.models import compute_weights, init_model
from jaxagent.models.config import ModelConfig
from jaxagent.train.sync import SamplerWeights
from sharding.config import DistributedConfig, MeshConfig
from sharding.distributed import initialize
from sharding.layout import Layout
from sharding.rules import shardings

MODEL = ModelConfig(vocab_size=72, hidden_size=24, intermediate_size=40, num_layers=2,
                    num_heads=6, num_kv_heads=2, head_dim=10, param_dtype="float32",
                    dtype="bfloat16", bos_token_id=None, eos_token_id=None, pad_token_id=None)

how = initialize(DistributedConfig())
layout = Layout(MeshConfig(data=1, fsdp=4, tensor=2))
assert dict(layout.sampler_mesh.shape) == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 2}
assert set(layout.sampler_mesh.devices.flat) == set(jax.local_devices())
graphdef, params = layout.split(init_model(MODEL, seed=2))
assert not jax.tree.leaves(params)[0].is_fully_addressable  # the masters span the processes
reference = nnx.state(init_model(MODEL, seed=2))  # the float32 masters, on this process

to_sampler = SamplerWeights.create(MODEL, layout, graphdef, None)
store = to_sampler.store(params, compute_weights(layout.sampler_params(params), MODEL))
for version in (1, 2):  # the second publish reuses the compiled program
    params = jax.tree.map(lambda x: x + 1.0, params)  # a trained step's new weights
    store.publish(version, params)
    published = store.take(version)
    reference = jax.tree.map(lambda x: x + 1.0, reference)
laid_out = shardings(published, layout.sampler_mesh, layout.rules)
whole = 0
for got, want, ruled in zip(jax.tree.leaves(published), jax.tree.leaves(reference),
                            jax.tree.leaves(laid_out)):
    assert got.is_fully_addressable and got.dtype == jnp.bfloat16, (got.sharding, got.dtype)
    assert got.sharding.is_equivalent_to(ruled, got.ndim), (got.sharding, ruled)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32))
    whole += got.nbytes
wq = published["layers"][0]["attn"]["wq"].get_value()
assert {s.data.shape for s in wq.addressable_shards} == {(24, 3, 10)}  # heads over tensor 2

# The move's program (bfloat16 in, as a publish casts first): per device, its blocks only.
cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
move = jax.jit(lambda t: t, out_shardings=shardings(cast, layout.publish_mesh, layout.rules))
memory = move.lower(cast).compile().memory_analysis()
blocks = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(published))
assert blocks <= memory.output_size_in_bytes < whole, (memory, blocks, whole)
print(f"{how}: ok: per device, the publish program takes {memory.argument_size_in_bytes} B, "
      f"makes {memory.output_size_in_bytes} B (its sampler blocks: {blocks} B) with "
      f"{memory.temp_size_in_bytes} B of temporaries; the whole bfloat16 model is {whole} B",
      flush=True)
