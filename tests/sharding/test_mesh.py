"""Mesh shapes from config: -1 fill, errors naming the sizes, axis order."""

import pytest

from jaxagent.errors import ConfigError
from sharding.config import MeshConfig
from sharding.mesh import AXES, build_mesh, mesh_shape


def test_fill_and_explicit_sizes():
    assert mesh_shape(MeshConfig(), 8) == {"data": 8, "fsdp": 1, "expert": 1, "tensor": 1}
    assert mesh_shape(MeshConfig(data=1, fsdp=-1, tensor=2), 8) == \
        {"data": 1, "fsdp": 4, "expert": 1, "tensor": 2}
    mesh = build_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert mesh.axis_names == AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    # Tensor groups are neighbours: consecutive devices share the trailing axis.
    ids = [[d.id for d in row] for row in mesh.devices.reshape(-1, 2)]
    assert all(b == a + 1 for a, b in ids)


@pytest.mark.parametrize("cfg, message", [
    (MeshConfig(data=3, fsdp=2), ("mesh.data=3, mesh.fsdp=2, mesh.expert=1, mesh.tensor=1 makes 6 "
                                 "devices, but there are 8")),
    (MeshConfig(data=-1, tensor=3), "cannot fill 8 devices"),
    (MeshConfig(data=-1, fsdp=-1), "at most one -1"),
    (MeshConfig(data=0), "sizes must be >= 1"),
    (MeshConfig(data=-1, dcn_data=3), "mesh.dcn_data=3 must divide mesh.data=8"),
])
def test_bad_sizes_are_named(cfg, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        build_mesh(cfg)


def test_hybrid_mesh_splits_data_over_processes():
    # One process here: two "nodes" cannot be formed, and the error says so.
    with pytest.raises(ValueError):
        build_mesh(MeshConfig(data=-1, dcn_data=2))
