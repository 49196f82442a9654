"""Where every array of a run lives: the trainer's mesh, the sampler's mesh, and the rules.

The trainer's mesh spans all processes' devices. In training the sampler's spans this
process's devices only: each process samples its own prompts, so its programs must not be
global SPMD ones. With one process and no `sampler.mesh`, both are the same mesh. A spanning
layout (`jaxagent eval` and `generate`) samples on a mesh over every process's devices
instead: every process runs the same sampling programs on one global batch, so a model too
large for one host samples sharded over all of them.

Publishing weights to the sampler is one program on the trainer's devices, never a whole copy
on one device or in host memory: every process's sampler mesh, side by side, is one global mesh
(a leading `process` axis, over which the weights are replicated), so laying the weights out on
it by the rules leaves each device holding exactly the block its own sampler mesh gives it; each
process then views its devices' blocks as arrays on its sampler mesh, copying nothing.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxagent.errors import ConfigError
from sharding.config import MeshConfig
from sharding.mesh import build_mesh
from sharding.rules import (
    activation_rules,
    check_batch,
    data_parallel,
    host_value,
    place,
    shard_batch,
    shardings,
)


def process_devices(devices: list[jax.Device]) -> list[list[jax.Device]]:
    """Each process's devices, by process index. Every process must have as many: each samples
    on a mesh of its own devices, and a publish lays the weights out on all those meshes side
    by side (`Layout.publish_mesh`), which needs them alike."""
    groups = [[d for d in devices if d.process_index == p]
              for p in sorted({d.process_index for d in devices})]
    if len({len(g) for g in groups}) > 1:
        counts = ", ".join(f"process {g[0].process_index}: {len(g)}" for g in groups)
        raise ConfigError(f"sampler.mesh: the processes have unequal device counts ({counts}); "
                          "each samples on a mesh of its own devices and a publish lays the "
                          "weights out on all of them at once, so every process needs as many "
                          "devices (give each process the same GPUs or CPU device count)")
    return groups


class Layout:
    def __init__(self, mesh: MeshConfig, sampler_mesh: MeshConfig | None = None, *,
                 spanning: bool = False):
        """`mesh`: the trainer's (config `mesh`); `sampler_mesh`: config `sampler.mesh`;
        `spanning`: the sampler's mesh spans every process's devices too (see above)."""
        self.rules = mesh.rules
        self.mesh = build_mesh(mesh)
        multi = jax.process_count() > 1
        if sampler_mesh is None and (spanning or not multi):
            self.sampler_mesh = self.mesh
        elif spanning:
            self.sampler_mesh = build_mesh(sampler_mesh, key="sampler.mesh")
        else:
            # Default across processes: this process's devices, tensor parallel as in training.
            sampler = sampler_mesh or MeshConfig(data=-1, tensor=mesh.tensor)
            # Every process's sampler mesh, built alike from its devices (so all agree on each).
            meshes = [build_mesh(sampler, devices, key="sampler.mesh")
                      for devices in process_devices(jax.devices())]
            self.sampler_mesh = meshes[jax.process_index()]
            # all of them as one mesh over every device (`sampler_params` lays weights out on it)
            self.publish_mesh = Mesh(np.stack([m.devices for m in meshes]),
                                      ("process", *self.sampler_mesh.axis_names))

    def check_batch(self, rows: int, key: str) -> None:
        """Fail before any compute if a global batch of `rows` cannot split over the mesh."""
        check_batch(rows, self.mesh, self.rules, key)

    @property
    def data_parallel(self) -> int:
        """The devices a training batch's rows split over."""
        return data_parallel(self.mesh, self.rules)

    # -- training -------------------------------------------------------------------------------

    def split(self, model: nnx.Module) -> tuple[Any, Any]:
        """(graphdef, params on the trainer's mesh)."""
        graphdef, params = nnx.split(model)
        return graphdef, self.place(params)

    def activations(self):
        """The rules context of the trainer's mesh: training programs called in it pin the
        model's activations (at layer boundaries) to the rules' layout."""
        return activation_rules(self.mesh, self.rules)

    def place(self, tree: Any) -> Any:
        """Params and/or optimizer state onto the trainer's mesh."""
        return place(tree, self.mesh, self.rules)

    def batch(self, local: Any, key: str = "the batch") -> Any:
        """This process's rows of the batch -> global arrays split over (data, fsdp).

        Processes pack their own rows, so time lengths may differ: all are right-padded with
        zeros (padding, no loss) to the longest.
        """
        if jax.process_count() > 1:
            longest = max(x.shape[1] for x in jax.tree.leaves(local) if x.ndim > 1)
            t = int(np.max(multihost_utils.process_allgather(np.int32(longest))))
            local = jax.tree.map(lambda x: x if x.ndim < 2 else np.pad(
                np.asarray(x), [(0, 0), (0, t - x.shape[1])] + [(0, 0)] * (x.ndim - 2)), local)
        return shard_batch(local, self.mesh, self.rules, key)

    def local_rows(self, n: int) -> slice:
        """This process's share of a global batch of `n` rows drawn the same in every process."""
        per = n // jax.process_count()
        return slice(jax.process_index() * per, (jax.process_index() + 1) * per)

    def host_copy(self, tree: Any) -> Any:
        """A whole copy of `tree` in this process's host memory, one array at a time (every
        process must call): for export, where no device may hold the whole model. An array on
        this process's devices comes over shard by shard; one spanning processes is first
        replicated, that array alone."""
        return host_value(tree)

    # -- sampling -------------------------------------------------------------------------------

    def sampler_params(self, params: Any) -> Any:
        """The trainer's params on the sampler's mesh: `params` themselves when the meshes are
        one, else a copy made on the devices (see the module's docstring; every process must
        call). Cast them first where they are, and the smaller copy moves."""
        if self.sampler_mesh is self.mesh:
            return params
        # one function for every publish: jit caches by function, so a fresh lambda would
        # trace and compile the copy again at each step
        spread = jax.jit(_identity, out_shardings=shardings(params, self.publish_mesh,
                                                            self.rules))(params)
        # This process's blocks, each on its device, are the sampler's arrays.
        return jax.tree.map(
            lambda x, s: jax.make_array_from_single_device_arrays(
                x.shape, s, [shard.data for shard in x.addressable_shards]),
            spread, shardings(params, self.sampler_mesh, self.rules))

    def sampler_model(self, graphdef: Any, params: Any, *, placed: bool = False) -> nnx.Module:
        """The sampler's model of the trainer's `params` (`placed`: of params already on the
        sampler's mesh)."""
        return nnx.merge(graphdef, params if placed else self.sampler_params(params))

    def sampler_activations(self):
        """`activations` for the sampler's mesh (`Sampler(activations=...)`)."""
        return activation_rules(self.sampler_mesh, self.rules)


def _identity(tree: Any) -> Any:
    return tree
