"""Run under launch/local_multihost.sh: join, shard a batch over (data, fsdp) across the
processes, check a global reduction; with `die`, process 1 dies and process 0 waits in a
collective for a peer that never comes."""

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sharding.config import DistributedConfig, MeshConfig
from sharding.distributed import initialize
from sharding.mesh import build_mesh
from sharding.rules import shard_batch

how = initialize(DistributedConfig(heartbeat_timeout_s=int(os.environ.get("HEARTBEAT", "60"))))
mesh = build_mesh(MeshConfig(data=2, fsdp=2))
rules = (("batch", "data", "fsdp"),)
rows = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # the global batch, 8 rows
per = 8 // jax.process_count()
local = rows[jax.process_index() * per:(jax.process_index() + 1) * per]
batch = shard_batch(local, mesh, rules)
assert batch.shape == (8, 3), batch.shape
assert {s.data.shape for s in batch.addressable_shards} == {(2, 3)}
weights = jnp.arange(3, dtype=jnp.float32) + 1
total = float(jax.jit(lambda b: (b * weights).sum())(batch))
assert total == float((rows * np.arange(1, 4)).sum()), total
print(f"{how}: ok {total}", flush=True)
if len(sys.argv) > 1 and sys.argv[1] == "die":
    if jax.process_index() == 1:
        os._exit(0)  # no goodbye: a crashed host
    time.sleep(2)
    jax.jit(lambda b: b.sum())(batch).block_until_ready()
    print("collective finished without the peer", flush=True)
