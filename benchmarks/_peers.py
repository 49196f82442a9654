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
    # Qwen2.5-0.5B and -1.5B dimensions in the Qwen3 layout (q/k RMSNorm where Qwen2.5 has
    # q/k/v biases: a few kFLOPs per token either way), untied LM head; the GPU sizes.
    "qwen2.5-0.5b": {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "head_dim": 64},
    "qwen2.5-1.5b": {"vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
                     "num_hidden_layers": 28, "num_attention_heads": 12,
                     "num_key_value_heads": 2, "head_dim": 128},
}


def make_checkpoint(size: str, path: Path, dtype: str = "float32") -> None:
    """Save a random HF Qwen3 checkpoint of SIZES[size] (safetensors, `dtype`) to `path`."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**SIZES[size], tie_word_embeddings=False,
                                   max_position_embeddings=4096, initializer_range=0.05)
    transformers.Qwen3ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(path)


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


def run_worker(cmd: list[str], timeout: float | None = None) -> tuple[list[dict], str]:
    """The JSON lines a peer worker printed, and why it stopped early ("" if it did not).

    On a timeout the rows printed so far are kept: a lent GPU's minutes are too scarce to lose
    the settings that did finish."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        out, err, reason = proc.stdout, proc.stderr, ""
        if proc.returncode:
            last = (err.strip().splitlines() or ["no output"])[-1]
            reason = f"worker exited {proc.returncode}: {last[:200]}"
    except subprocess.TimeoutExpired as e:  # captured output is bytes here, whatever `text` says
        out = (e.stdout or b"").decode(errors="replace")
        err = (e.stderr or b"").decode(errors="replace")
        reason = f"worker stopped after {timeout:.0f} s"
    if reason:
        print(err[-3000:], file=sys.stderr)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")], reason


def even_fraction(ids) -> float:
    """The GRPO benchmark's reward, the same for every stack: fraction of even token ids."""
    return sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1)


class IdTokenizer:
    """Prompts travel as space-separated token ids, so Tunix sees the exact same tokens.

    eos is -1 (never sampled), so every row generates exactly the requested new tokens.
    """

    add_bos = False

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


def load_tunix_qwen3(checkpoint: str, param_dtype: str = "float32", dtype: str | None = None):
    """Tunix's Qwen3 from an HF checkpoint directory: `param_dtype` parameters, activations in
    `dtype` (default: the same)."""
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
        norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"],
        param_dtype=jnp.dtype(param_dtype), dtype=jnp.dtype(dtype or param_dtype))
    model = qwen3_params.create_model_from_safe_tensors(checkpoint, cfg,
                                                         dtype=jnp.dtype(param_dtype))
    return model, cfg
