"""Logical axis names -> `PartitionSpec`s, and placing parameters, optimizer state and batches.

Models name each parameter dimension (`logical_axes` metadata: "embed", "heads", "expert"...)
and each activation they hand to `Decoder.shard_activations`; the rules table (config
`mesh.rules`, rows `[logical, mesh axes...]`) maps names to mesh axes. A dimension takes the
rule's mesh axes that have size > 1, divide it, and are not already used by an earlier
dimension of the same array; everything else is replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Rules = tuple[tuple[str, ...], ...]


def partition_spec(shape: Sequence[int], names: Sequence[str | None], rules: Rules,
                   mesh: Mesh) -> PartitionSpec:
    """The spec of one array of `shape` whose dimensions are called `names`."""
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match the shape {tuple(shape)}")
    table = {row[0]: row[1:] for row in rules}
    used: set[str] = set()
    spec = []
    for size, name in zip(shape, names):
        axes = []
        for axis in table.get(name, ()) if name is not None else ():
            if axis not in mesh.shape:
                raise ValueError(f"mesh.rules: {name!r} -> unknown mesh axis {axis!r} "
                                 f"(axes: {', '.join(mesh.axis_names)})")
            n = mesh.shape[axis] * int(np.prod([mesh.shape[a] for a in axes]))
            if mesh.shape[axis] > 1 and axis not in used and size % n == 0:
                axes.append(axis)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def shardings(tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """A NamedSharding for every array of `tree` (params, optimizer state, or both): from the
    `logical_axes` of the Variable holding it, replicated when it has none (step counters)."""

    def one(x):
        if _is_variable(x):
            names = x.get_metadata().get("logical_axes")
            value = x.get_value()
            spec = (partition_spec(value.shape, names, rules, mesh) if names is not None
                    else PartitionSpec())
            return x.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def place(tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """`tree` resharded onto `mesh` per the rules (from any mesh or device: a copy)."""
    return jax.device_put(tree, shardings(tree, mesh, rules))


def batch_sharding(mesh: Mesh, rules: Rules, shape: Sequence[int]) -> NamedSharding:
    """Leading dimension "batch", the rest replicated."""
    names = ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, partition_spec(shape, names, rules, mesh))


def shard_batch(batch: Any, mesh: Mesh, rules: Rules) -> Any:
    """A host batch (the same global batch in every process) as global arrays split over the
    batch axes; each process supplies only the rows of its own devices."""

    def one(x):
        x = np.asarray(x)
        sharding = batch_sharding(mesh, rules, x.shape)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    return jax.tree.map(one, batch)


def check_batch(size: int, mesh: Mesh, key: str) -> None:
    """The batch must split evenly over the data-parallel devices."""
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    if size % n:
        raise ValueError(f"{key}: the batch ({size}) must be a multiple of mesh.data * "
                         f"mesh.fsdp ({n})")


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
    """`Decoder.shard_activations`: pins an activation to the rules' layout (hashable, so it
    can live in a graphdef that keys compiled steps)."""

    mesh: Mesh
    rules: Rules

    def __call__(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        spec = partition_spec(x.shape, names, self.rules, self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
