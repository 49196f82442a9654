"""Peer measurement: Tunix's JAX sampler on an HF Qwen3 checkpoint (runs in Tunix's own venv).

Prints one JSON line per (batch, new_tokens) setting. Called by benchmarks/sampler.py.
"""

import argparse
import json
import sys
import time

import jax
import numpy as np
from _peers import IdTokenizer, load_tunix_qwen3
from tunix.generate.sampler import CacheConfig, Sampler


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--settings", required=True, help="JSON list of [batch, prompt_len, new_tokens]")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="float32", help="parameters and activations")
    args = p.parse_args()
    start = time.perf_counter()
    model, cfg = load_tunix_qwen3(args.checkpoint, args.dtype)
    # where the time goes before the first result (stderr comes back when the worker is cut)
    print(f"loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
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
        print(f"{batch}x{prompt_len}+{new_tokens} compiled at {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
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
