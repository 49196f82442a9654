"""Peer measurement: Tunix's JAX sampler on an HF Qwen3 checkpoint (runs in Tunix's own venv).

Prints one JSON line per (batch, new_tokens) setting. Called by benchmarks/sampler.py.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from tunix.generate.sampler import CacheConfig, Sampler
from tunix.models.qwen3 import model as qwen3_model
from tunix.models.qwen3 import params as qwen3_params


class IdTokenizer:
    """Prompts travel as space-separated token ids, so Tunix sees the exact same tokens."""

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


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--settings", required=True, help="JSON list of [batch, prompt_len, new_tokens]")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    hf = json.load(open(f"{args.checkpoint}/config.json"))
    rope = hf.get("rope_parameters") or {}
    cfg = qwen3_model.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope.get("rope_theta", hf.get("rope_theta", 10000))),
        norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"])
    model = qwen3_params.create_model_from_safe_tensors(args.checkpoint, cfg, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    for batch, prompt_len, new_tokens in json.loads(args.settings):
        sampler = Sampler(model, IdTokenizer(), CacheConfig(
            cache_size=prompt_len + new_tokens + 8, num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
        prompts = [" ".join(map(str, rng.integers(1, cfg.vocab_size, prompt_len)))
                   for _ in range(batch)]
        kwargs = dict(max_generation_steps=new_tokens, max_prompt_length=prompt_len,
                      temperature=0.0, eos_tokens=[-1])
        sampler(prompts, **kwargs)  # compile
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = sampler(prompts, **kwargs)
            jax.block_until_ready(out.tokens)
            best = min(best, time.perf_counter() - t0)
        generated = sum(len(t) for t in out.tokens)
        print(json.dumps(dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                              seconds=best, generated=generated)), flush=True)


if __name__ == "__main__":
    main()
