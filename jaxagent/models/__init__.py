"""Flax NNX decoders (Llama / Qwen2 / Qwen3) and HF checkpoint import/export."""

from jaxagent.models.attention import BACKENDS, register_backend
from jaxagent.models.hf import CheckpointError, from_pretrained, read_config, save_pretrained
from jaxagent.models.llama import Decoder, KVCache, init_model, logical_axes

__all__ = [
    "BACKENDS",
    "CheckpointError",
    "Decoder",
    "KVCache",
    "from_pretrained",
    "init_model",
    "logical_axes",
    "read_config",
    "register_backend",
    "save_pretrained",
]
