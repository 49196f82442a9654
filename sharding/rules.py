"""Placing parameters, optimizer state and batches by their logical axis names, and the rules
context activations are pinned in.

Models name each parameter dimension (`logical_axes` metadata: "embed", "heads", "expert"...)
and each activation they pin (`jaxagent.models.params.constrain`); the rules table (config
`mesh.rules`, rows `[logical, mesh axes...]`) maps names to mesh axes
(`jaxagent.models.params.logical_spec`: a dimension takes the rule's mesh axes that have size
> 1, divide it, and are not already used by an earlier dimension of the same array; everything
else is replicated).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxagent.errors import ConfigError
from jaxagent.models.params import logical_spec, rule_table

Rules = tuple[tuple[str, ...], ...]


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def shardings(tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """A NamedSharding for every array of `tree` (params, optimizer state, or both): from the
    `logical_axes` of the Variable holding it, replicated when it has none (step counters)."""

    def one(x):
        if _is_variable(x):
            names = x.get_metadata().get("logical_axes")
            value = x.get_value()
            spec = (logical_spec(value.shape, names, rules, mesh) if names is not None
                    else PartitionSpec())
            return x.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def place(tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """`tree` resharded onto `mesh` per the rules (from any mesh or device: a copy)."""
    return jax.device_put(tree, shardings(tree, mesh, rules))


def data_parallel(mesh: Mesh, rules: Rules) -> int:
    """The devices a batch's rows split over: the rules' "batch" mesh axes."""
    return int(np.prod([mesh.shape[a] for a in rule_table(rules).get("batch", ())]))


def check_batch(rows: int, mesh: Mesh, rules: Rules, key: str) -> None:
    """A global batch of `rows` must split evenly over the rules' "batch" mesh axes."""
    devices = data_parallel(mesh, rules)
    if rows % devices:
        raise ConfigError(f"{key}: the global batch ({rows} rows) does not split over the "
                          f"{devices} data-parallel devices (mesh axes of 'batch' in "
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
        spec = logical_spec((rows, *x.shape[1:]), ("batch",) + (None,) * (x.ndim - 1),
                              rules, mesh)
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x)

    return jax.tree.map(one, local)


def host_value(tree: Any) -> Any:
    """Every array of `tree` whole in this process's host memory, one array at a time. An
    array on this process's devices (or replicated on every device) comes over shard by shard;
    one split over several processes' devices is gathered, so every process must call alike."""
    return jax.tree.map(lambda x: jax.device_get(x) if x.is_fully_addressable
                        or x.is_fully_replicated
                        else np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


@contextlib.contextmanager
def activation_rules(mesh: Mesh, rules: Rules):
    """The rules context models pin their activations in (`jaxagent.models.params.constrain`):
    `rules` as flax's logical axis rules, on `mesh` as jax's abstract mesh (which keys jit's
    cache, so a program traced in it is compiled for this layout; the rules are one table per
    run). Thread-local: enter it in the thread that calls the model's programs."""
    pairs = tuple(rule_table(rules).items())
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nnx.logical_axis_rules(pairs):
        yield
