"""A checkpoint saved on one mesh restores onto another mesh shape with identical values."""

import jax
import numpy as np
from flax import nnx

from jaxagent.checkpoint import Checkpointer
from jaxagent.config import OptimizerConfig
from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from jaxagent.optim import make_optimizer
from sharding.config import DEFAULT_AXIS_RULES, MeshConfig
from sharding.mesh import build_mesh
from sharding.rules import place, shardings

MODEL = ModelConfig(vocab_size=72, hidden_size=24, intermediate_size=40, num_layers=1,
                    num_heads=6, num_kv_heads=2, head_dim=10, tie_embeddings=False)


def test_restore_data4_checkpoint_onto_fsdp2_tensor2(tmp_path):
    rules = DEFAULT_AXIS_RULES
    saving = build_mesh(MeshConfig(data=4), jax.devices()[:4])
    loading = build_mesh(MeshConfig(data=1, fsdp=2, tensor=2), jax.devices()[4:])
    tx = make_optimizer(OptimizerConfig(), 10)
    _, params = nnx.split(init_model(MODEL, seed=5))
    # Non-trivial optimizer moments: one update's worth of random gradients.
    rng = np.random.default_rng(1)
    grads = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params)
    opt_state = jax.jit(tx.update)(grads, tx.init(params), params)[1]
    state = place({"params": params, "opt_state": opt_state}, saving, rules)
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(3, state, {"step": 3})
    ckpt.wait()

    fresh = jax.tree.map(np.zeros_like, params)  # other values, the same structure
    like = place({"params": fresh, "opt_state": tx.init(fresh)}, loading, rules)
    restored, extra = ckpt.restore(3, like)
    ckpt.close()
    assert extra == {"step": 3}
    want = jax.tree.leaves(shardings(like, loading, rules))
    saved, got = jax.tree.leaves(state), jax.tree.leaves(restored)
    assert len(saved) == len(got) == len(want)
    split = 0
    for a, b, sharding in zip(saved, got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert b.sharding.is_equivalent_to(sharding, b.ndim)
        assert set(b.sharding.device_set) == set(jax.devices()[4:])
        split += b.addressable_shards[0].data.shape != b.shape
    assert split > 0  # tensor / fsdp really split some arrays on the new mesh
    wq = restored["params"]["layers"][0]["attn"]["wq"].get_value()
    assert wq.addressable_shards[0].data.shape == (12, 3, 10)
