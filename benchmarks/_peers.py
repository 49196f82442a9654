"""Helpers shared by the peer benchmarks (sampler.py, grpo_step.py) and their Tunix workers.

The workers (_tunix_*.py) run in Tunix's own venv, so nothing here imports jaxagent, and the
heavy imports (torch, transformers, tunix) happen inside the functions that need them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TUNIX_VENV = HERE / ".venv-tunix"

SIZES = {
    # The tiny Qwen3 (2 layers, d_model 128) and a ~100M one.
    "tiny": {"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 512,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32},
    "100m": {"vocab_size": 32768, "hidden_size": 768, "intermediate_size": 2048,
             "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
             "head_dim": 64},
}


def make_checkpoint(size: str, path: Path) -> None:
    """Save a random HF Qwen3 checkpoint of SIZES[size] (safetensors) to `path`."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**SIZES[size], tie_word_embeddings=False,
                                   max_position_embeddings=4096, initializer_range=0.05)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)


def ensure_tunix() -> Path:
    """Python of benchmarks/.venv-tunix, installing google-tunix there on first use."""
    import jax

    python = TUNIX_VENV / "bin" / "python"
    if not python.exists():
        print("installing google-tunix into", TUNIX_VENV, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(TUNIX_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "google-tunix",
                        f"jax=={jax.__version__}", f"jaxlib=={jax.__version__}"], check=True)
    return python


def even_fraction(ids) -> float:
    """The GRPO benchmark's reward, the same for every stack: fraction of even token ids."""
    return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)


class IdTokenizer:
    """Prompts travel as space-separated token ids, so Tunix sees the exact same tokens.

    eos is -1 (never sampled), so every row generates exactly the requested new tokens.
    """

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(map(str, ids))

    def bos_id(self):
        return None

    def eos_id(self):
        return -1

    def pad_id(self):
        return 0


def load_tunix_qwen3(checkpoint: str):
    """Tunix's Qwen3 (float32) from an HF checkpoint directory."""
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params

    with open(f"{checkpoint}/config.json") as f:
        hf = json.load(f)
    rope = hf.get("rope_parameters") or {}
    cfg = qwen3_model.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope.get("rope_theta", hf.get("rope_theta", 10000))),
        norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"])
    return qwen3_params.create_model_from_safe_tensors(checkpoint, cfg, dtype=jnp.float32), cfg
