"""The `sampler` config section: sampling defaults and the buckets that keep jitted shapes
repeating. jaxagent.config composes it into `Config`."""

from __future__ import annotations

from dataclasses import dataclass

from sharding.config import MeshConfig


@dataclass(frozen=True)
class SamplerConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    # Prompt and cache lengths are rounded up to these multiples so jitted shapes repeat.
    prompt_bucket: int = 64
    cache_bucket: int = 64
    batch_bucket: int = 8
    # CPU only: threads a call's batch is split over (each decodes its rows; 1.4x at batch 32
    # on 2 cores); None = the cores this process may use. Ignored on accelerators and meshes.
    host_threads: int | None = None
    # The sampler's own mesh (e.g. pure tensor parallel); None: the trainer's mesh. Weights
    # are resharded onto it after each update.
    mesh: MeshConfig | None = None
