"""What the sampler runs of the trainer's weights, and what a publish sends it.

Full fine-tuning: every weight, cast to the sampler's compute dtype where the trainer holds
it, then moved onto the sampler's mesh (`Layout.sampler_params`: a program on the devices, so
the half-size copy moves) at each publish. LoRA: the sampler keeps its own copy of the frozen
base (made once, in its compute dtype), and a publish sends the adapters alone (float32 until
merged); `model.lora.sampler` says what the sampler makes of them: `merged` adds s A B into a
fresh copy of the base (decoding runs at the base model's speed), `unmerged` runs them beside
the base (no copy; every adapted projection pays x A B per token).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from flax import nnx

from jaxagent.models import compute_weights
from jaxagent.models.adapters import base_graphdef
from jaxagent.models.config import LoraConfig, ModelConfig
from jaxagent.models.lora import merge
from rollouts.orchestrator import WeightStore
from sharding.layout import Layout


@functools.partial(jax.jit, static_argnums=2)
def _merged(base, factors, lora: LoraConfig):
    return merge(base, factors, lora)


@dataclasses.dataclass(frozen=True)
class SamplerWeights:
    layout: Layout
    graphdef: Any  # the sampler's model: the trainer's, or without adapters when merged
    base: Any = None  # LoRA: the frozen base on the sampler's mesh, in its compute dtype
    lora: LoraConfig | None = None  # merged LoRA: the adapters' config (their scale)

    @classmethod
    def create(cls, cfg: ModelConfig, layout: Layout, graphdef, frozen) -> SamplerWeights:
        """For a model of `cfg` trained as `graphdef` over `frozen` (LoRA's base, or None)."""
        if frozen is None:
            return cls(layout, graphdef)
        base = layout.sampler_params(compute_weights(frozen, cfg))
        if cfg.lora.sampler == "unmerged":
            return cls(layout, graphdef, base)
        return cls(layout, base_graphdef(cfg), base, cfg.lora)

    def weights(self, params):
        """The sampler's weights of the trained `params` (every weight, or the adapters):
        moved onto the sampler's mesh, then with LoRA joined to its base."""
        params = self.layout.sampler_params(params)
        if self.base is None:
            return params
        if self.lora is None:
            return nnx.merge_state(self.base, params)
        return _merged(self.base, params, self.lora)

    def model(self, params) -> nnx.Module:
        return self.layout.sampler_model(self.graphdef, self.weights(params), placed=True)

    def store(self, params, sampler_params) -> WeightStore:
        """A store of published versions of the trained `params`: each copied where the
        trainer holds it (every weight in the sampler's dtype, like `sampler_params`; adapters
        as trained: the train step donates its own buffers), then made the sampler's
        `weights`."""
        dtypes = jax.tree.map(lambda x: x.dtype, sampler_params if self.base is None else params)
        return WeightStore(jax.tree.map(lambda x: x.sharding, params), dtypes,
                           prepare=self.weights)
