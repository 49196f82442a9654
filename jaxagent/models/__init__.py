"""Flax NNX decoders (Llama / Qwen2 / Qwen3) and HF checkpoint import/export; config.py: the
`model` config section."""

from jaxagent.models.documents import document_layout
from jaxagent.models.hf import CheckpointError, from_pretrained, read_config, save_pretrained
from jaxagent.models.llama import (Decoder, KVCache, compute_weights, init_model, logical_axes,
                                   sees_all_segments)

__all__ = [
    "CheckpointError",
    "compute_weights",
    "Decoder",
    "document_layout",
    "KVCache",
    "from_pretrained",
    "init_model",
    "logical_axes",
    "read_config",
    "save_pretrained",
    "sees_all_segments",
]
