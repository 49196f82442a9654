"""The `mesh` and `distributed` config sections (and `sampler.mesh`): device meshes, the
logical-axis rules and multi-process start-up. Sharding owns them so it never imports
jaxagent.config; jaxagent.config composes them into `Config`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Logical axis -> mesh axes. Parameters and activations name their dimensions with logical
# axes; a dimension takes the listed mesh axes that divide it and that no earlier dimension of
# the same array uses. Names not listed are replicated.
DEFAULT_AXIS_RULES: tuple[tuple[str, ...], ...] = (
    ("batch", "data", "fsdp"),  # activations: the batch over all data-parallel devices
    ("embed", "fsdp"),  # FSDP: weights' model dimension split, gathered per use
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "expert"),
)


@dataclass(frozen=True)
class MeshConfig:
    """A device mesh (data, fsdp, expert, tensor); -1 takes the devices the others leave."""

    data: int = -1  # pure data parallel (replicated weights)
    fsdp: int = 1  # data parallel with weights and optimizer state sharded on `embed`
    tensor: int = 1  # tensor parallel (heads, mlp, vocab): keep within fast links
    expert: int = 1  # expert parallel (MoE experts)
    dcn_data: int = 1  # of `data`, replicas over slow links (TPU slices, GPU nodes)
    rules: tuple[tuple[str, ...], ...] = DEFAULT_AXIS_RULES  # [logical, mesh axes...] rows


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process start-up (`jax.distributed`); explicit fields beat the environment."""

    # auto: explicit fields, else JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID,
    # else a detected TPU pod, SLURM job or Kubernetes JobSet, else one process. off: one.
    mode: Literal["auto", "off"] = "auto"
    coordinator_address: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout_s: int = 300  # waiting for every process to join
    heartbeat_timeout_s: int = 60  # a peer silent this long stops all the others
