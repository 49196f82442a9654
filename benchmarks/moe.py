"""MoE MLP dispatch: dropless (sort + ragged_dot) vs capacity buffers vs dense (every expert on
every token), forward + backward of one layer, side by side in one run.

Same router, experts and tokens for each mode; prints ms per step and each mode's time as a
ratio of dropless. Sizes are Qwen3-MoE-like ratios scaled down for a CPU (E 16, K 4 by
default; Qwen3-30B-A3B has E 128, K 8, where dense costs E/K = 16x the expert FLOPs).

    python benchmarks/moe.py
    python benchmarks/moe.py --tokens 4096 --experts 32 --top-k 4
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxagent.models.config import ModelConfig
from jaxagent.models.moe import MoE

MODES = ("dropless", "capacity", "dense")


def step_fn(cfg: ModelConfig):
    graphdef, params = nnx.split(MoE(cfg, rngs=nnx.Rngs(params=0)))

    @jax.jit
    def step(p, x, mask):
        def loss(p):
            y, _ = nnx.merge(graphdef, p)(x, mask)
            return (y * y).mean()
        return jax.value_and_grad(loss)(p)

    return step, params


def time_mode(cfg, x, mask, repeats):
    step, params = step_fn(cfg)
    jax.block_until_ready(step(params, x, mask))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, x, mask))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--expert-mlp", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    cfg = ModelConfig(hidden_size=args.hidden, moe_intermediate_size=args.expert_mlp,
                      num_experts=args.experts, num_experts_per_tok=args.top_k,
                      capacity_factor=args.capacity_factor, param_dtype=args.dtype,
                      dtype=args.dtype)
    x = jax.random.normal(jax.random.key(1), (1, args.tokens, args.hidden), args.dtype)
    mask = jnp.ones((1, args.tokens), bool)
    print(f"{platform.node()} {jax.devices()[0].platform} jax {jax.__version__}: "
          f"N={args.tokens} D={args.hidden} F={args.expert_mlp} E={args.experts} "
          f"K={args.top_k} capacity_factor={args.capacity_factor} {args.dtype}, fwd+bwd, "
          f"median of "
          f"{args.repeats}")
    ms = {mode: time_mode(dataclasses.replace(cfg, moe_dispatch=mode), x, mask, args.repeats)
          for mode in MODES}
    for mode, t in ms.items():
        print(f"  {mode:9s} {t:8.2f} ms   x{t / ms['dropless']:.2f} of dropless")


if __name__ == "__main__":
    main()
