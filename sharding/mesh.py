"""A `jax.sharding.Mesh` from `MeshConfig`: axes (data, fsdp, expert, tensor).

Axis order matters for speed: `mesh_utils` gives the last axes the closest devices, so
`tensor` (an all-reduce in every layer) is last and `data` (one gradient all-reduce per step)
first. With `dcn_data > 1` the data axis is split into replicas over slow links (TPU slices
or GPU nodes) and every other axis stays inside one slice / node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from jaxagent.errors import ConfigError
from sharding.config import MeshConfig

AXES = ("data", "fsdp", "expert", "tensor")


def mesh_shape(cfg: MeshConfig, num_devices: int, key: str = "mesh") -> dict[str, int]:
    """{axis: size} with the -1 axis filled; an error names the sizes if they do not fit."""
    sizes = {a: getattr(cfg, a) for a in AXES}
    listing = ", ".join(f"{key}.{a}={s}" for a, s in sizes.items())
    fill = [a for a, s in sizes.items() if s == -1]
    bad = [a for a, s in sizes.items() if s == 0 or s < -1]
    if bad or len(fill) > 1:
        raise ConfigError(f"{key}: sizes must be >= 1 with at most one -1, got {listing}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if num_devices % known:
            raise ConfigError(f"{key}: {listing} cannot fill {num_devices} devices "
                              f"({num_devices} is not a multiple of {known})")
        sizes[fill[0]] = num_devices // known
    if math.prod(sizes.values()) != num_devices:
        raise ConfigError(f"{key}: {listing} makes {math.prod(sizes.values())} devices, "
                          f"but there are {num_devices}")
    if cfg.dcn_data < 1 or sizes["data"] % cfg.dcn_data:
        raise ConfigError(f"{key}.dcn_data={cfg.dcn_data} must divide {key}.data="
                          f"{sizes['data']}")
    return sizes


def build_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None,
               key: str = "mesh") -> Mesh:
    """The mesh over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_shape(cfg, len(devices), key)
    shape = tuple(sizes[a] for a in AXES)
    if cfg.dcn_data > 1:
        ici = (sizes["data"] // cfg.dcn_data, *shape[1:])
        dcn = (cfg.dcn_data, 1, 1, 1)
        # TPU slices carry a slice_index; on GPU clusters a process is one node's granule.
        by_process = not hasattr(devices[0], "slice_index")
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                    process_is_granule=by_process)
    else:
        # TPU: a torus-aware assignment; GPU: devices by global id, so a node's GPUs (its
        # NVLink domain) are consecutive and the trailing tensor groups stay within it.
        grid = mesh_utils.create_device_mesh(shape, devices)
    return Mesh(grid, AXES)
