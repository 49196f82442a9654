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

from jaxagent.errors import ConfigError

Rules = tuple[tuple[str, ...], ...]


def _table(rules: Rules) -> dict[str, tuple[str, ...]]:
    return {row[0]: row[1:] for row in rules}


def partition_spec(shape: Sequence[int], names: Sequence[str | None], rules: Rules,
                   mesh: Mesh) -> PartitionSpec:
    """The spec of one array of `shape` whose dimensions are called `names`."""
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match the shape {tuple(shape)}")
    table = _table(rules)
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


def check_batch(rows: int, mesh: Mesh, rules: Rules, key: str) -> None:
    """A global batch of `rows` must split evenly over the rules' "batch" mesh axes."""
    data_parallel = int(np.prod([mesh.shape[a] for a in _table(rules).get("batch", ())]))
    if rows % data_parallel:
        raise ConfigError(f"{key}: the global batch ({rows} rows) does not split over the "
                          f"{data_parallel} data-parallel devices (mesh axes of 'batch' in "
                          "mesh.rules)")


def shard_batch(local: Any, mesh: Mesh, rules: Rules, key: str = "the batch") -> Any:
    """This process's rows of a batch -> global arrays with the leading dimension "batch"
    (split over data and fsdp by default) and the rest replicated. Across processes the rows
    must split evenly; in one process an array whose rows do not (shared-prompt group rows)
    is replicated."""

    def one(x):
        x = np.asarray(x)
        rows = x.shape[0] * jax.process_count()
        if jax.process_count() > 1:  # else a leading dimension that does not split replicates
            check_batch(rows, mesh, rules, key)
        spec = partition_spec((rows, *x.shape[1:]), ("batch",) + (None,) * (x.ndim - 1),
                              rules, mesh)
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x)

    return jax.tree.map(one, local)


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
    """`Decoder.shard_activations`: pins an activation to the rules' layout (hashable, so it
    can live in a graphdef that keys compiled steps)."""

    mesh: Mesh
    rules: Rules

    def __call__(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        spec = partition_spec(x.shape, names, self.rules, self.mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))
