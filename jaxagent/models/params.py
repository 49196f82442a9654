"""Logical axis names, the models' whole view of sharding. Every weight carries its own
(`param`), activations are pinned by theirs (`constrain`), and `logical_spec` resolves names to
mesh axes under a rules table: the one resolution, which sharding/ also uses for parameters and
batches.

Where activations go is set from outside, by a rules context: flax's `logical_axis_rules` on
jax's abstract mesh (`jax.sharding.use_abstract_mesh`), which `sharding.rules.activation_rules`
enters around the programs that run a model. Both are thread-local, and the abstract mesh is
part of jit's cache key, so a program traced under a layout is compiled for it."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core import spmd
from jax.sharding import NamedSharding, PartitionSpec

INIT_STD = 0.02


def param(rngs: nnx.Rngs, shape, axes, dtype, init="normal", kind=nnx.Param) -> nnx.Param:
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "zeros":
        value = jnp.zeros(shape, dtype)
    else:
        value = (INIT_STD * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return kind(value, logical_axes=axes)


def rule_table(rules) -> dict[str, tuple[str, ...]]:
    """{logical name: mesh axes} of rules given as rows `(logical, mesh axes...)` (config
    `mesh.rules`) or as flax's pairs `(logical, mesh axis or axes)`."""
    table = {}
    for name, *parts in rules:
        parts = [(p,) if isinstance(p, str) else p or () for p in parts]
        table[name] = tuple(axis for axes in parts for axis in axes)
    return table


def logical_spec(shape: Sequence[int], names: Sequence[str | None], rules, mesh) -> PartitionSpec:
    """The spec of one array of `shape` whose dimensions are called `names`, on `mesh` (a Mesh
    or an AbstractMesh): a dimension takes its rule's mesh axes that have size > 1, divide it,
    and are not already used by an earlier dimension of the array; the rest is replicated."""
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match the shape {tuple(shape)}")
    table = rule_table(rules)
    sizes = dict(mesh.shape)
    used: set[str] = set()
    spec = []
    for size, name in zip(shape, names):
        axes = []
        for axis in table.get(name, ()) if name is not None else ():
            if axis not in sizes:
                raise ValueError(f"mesh.rules: {name!r} -> unknown mesh axis {axis!r} "
                                 f"(axes: {', '.join(mesh.axis_names)})")
            n = sizes[axis] * int(np.prod([sizes[a] for a in axes]))
            if sizes[axis] > 1 and axis not in used and size % n == 0:
                axes.append(axis)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`x` pinned to the layout its logical axis `names` have under the rules context (see the
    module's doc); outside one, `x` unchanged."""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    spec = logical_spec(x.shape, names, rules, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
