"""`jax.distributed` from the config and the environment, in one call at start-up.

Where the processes come from, in order: explicit `distributed.*` fields; the variables that
`launch/` scripts set (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); a TPU pod,
SLURM job or Kubernetes JobSet, which `jax.distributed` detects itself; otherwise one process.

Every process runs the same program: all join collectives and checkpoint saves, and only
process 0 writes logs, metrics and plots (`is_leader`). A peer that dies stops the others after
`heartbeat_timeout_s` (the coordination service's heartbeat) instead of hanging in a
collective.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxagent.errors import ConfigError
from sharding.config import DistributedConfig

_EXPLICIT = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def detect(cfg: DistributedConfig, env: Mapping[str, str]) -> tuple[str, dict] | None:
    """(how, arguments for jax.distributed.initialize), or None for a single process."""
    if cfg.mode == "off":
        return None
    fields = (cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    if any(f is not None for f in fields):
        if None in fields:
            raise ConfigError("distributed: coordinator_address, num_processes and process_id "
                              "go together (got "
                              f"{cfg.coordinator_address!r}, {cfg.num_processes!r}, "
                              f"{cfg.process_id!r})")
        return "config", {"coordinator_address": cfg.coordinator_address,
                              "num_processes": cfg.num_processes, "process_id": cfg.process_id}
    present = [k for k in _EXPLICIT if env.get(k)]
    if present:
        if len(present) < len(_EXPLICIT):
            missing = sorted(set(_EXPLICIT) - set(present))
            raise ConfigError(f"environment: {', '.join(present)} set but {', '.join(missing)} "
                              "missing")
        try:
            n, i = int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
        except ValueError:
            raise ConfigError("environment: JAX_NUM_PROCESSES and JAX_PROCESS_ID must be "
                              "integers") from None
        return "environment", {"coordinator_address": env["JAX_COORDINATOR_ADDRESS"],
                                   "num_processes": n, "process_id": i}
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env:
        return "slurm", {}
    if env.get("TPU_WORKER_HOSTNAMES") or env.get("TPU_PROCESS_ADDRESSES") or \
            env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu", {}
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        return "kubernetes", {}
    return None


def initialize(cfg: DistributedConfig, env: Mapping[str, str] | None = None) -> str:
    """Join the other processes (a no-op for one process); returns how they were found."""
    env = os.environ if env is None else env
    found = detect(cfg, env)
    if found is None:
        return "single process"
    how, kwargs = found
    if env.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        # CPU collectives across processes need an implementation; gloo ships with jaxlib.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs,
                               initialization_timeout=cfg.initialization_timeout_s,
                               heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    return f"{how}: process {jax.process_index()} of {jax.process_count()}"


def is_leader() -> bool:
    """Process 0: the one that writes logs, metrics and plots."""
    return jax.process_index() == 0


def process_share(n: int, p: int, count: int) -> range:
    """Process `p`'s contiguous share of `n` items split over `count` processes in process
    order: the first `n % count` take one more."""
    per, extra = divmod(n, count)
    start = p * per + min(p, extra)
    return range(start, start + per + (p < extra))


def gather(items: list) -> list:
    """Every process's `items` (JSON values), in process order, in every process: all must
    call (two all-gathers, of the sizes and of the padded bytes)."""
    if jax.process_count() == 1:
        return list(items)
    data = np.frombuffer(json.dumps(items).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    every = np.asarray(multihost_utils.process_allgather(padded))
    return [x for row, n in zip(every, sizes) for x in json.loads(row[:n].tobytes())]
