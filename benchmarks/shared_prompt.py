"""Train-step time with and without shared-prompt packing, side by side in one run.

A GRPO step trains G completions of one prompt. Unshared, each row is `prompt + completion`
and the prompt runs G times; shared (`jaxagent.steps.pack_shared`), a group is one row
`[prompt, completion_1..G]` whose completions attend to the prompt and to themselves, so the
prompt runs once. Same loss and gradients (tests/jaxagent/test_steps.py); at prompt 2048,
G=8, completion 256 the token ratio is (8 * 2304) : (2048 + 8 * 256) = 18432 : 4096 = 4.5x.

    python benchmarks/shared_prompt.py                       # tiny model (CPU)
    python benchmarks/shared_prompt.py --model qwen2.5-0.5b  # a 0.5B Qwen2.5 shape, bf16 (GPU)
    python benchmarks/shared_prompt.py --model qwen2.5-0.5b --attention doc  # Pallas kernel

Timed: one jitted `rl_step` (forward, backward, AdamW update) on random tokens and advantages,
`--warmup` untimed steps (compilation) then the median of `--steps`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxagent.config import OptimizerConfig
from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from jaxagent.optim import make_optimizer
from jaxagent.steps import LossOptions, pack, pack_shared, rl_step

MODELS = {
    "tiny": ModelConfig(),
    # Qwen2.5-0.5B's shape (random weights): 24 layers, d 896, 14 heads / 2 kv heads.
    "qwen2.5-0.5b": ModelConfig(
        family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, attention_bias=True,
        qk_norm=False, tie_embeddings=True, rope_theta=1e6, dtype="bfloat16",
        param_dtype="bfloat16"),
}


def time_steps(graphdef, params, batch, warmup: int, steps: int, *,
               options: LossOptions = LossOptions(), micro_batch: int = 0) -> float:
    """Median seconds of a jitted rl_step (after `warmup` compiling calls); with a KL term
    against a copy of the weights when `options.kl_coef` asks for one."""
    params = jax.tree.map(jnp.copy, params)  # rl_step donates its inputs
    ref = jax.tree.map(jnp.copy, params) if options.kl_coef else None
    tx = make_optimizer(OptimizerConfig(learning_rate=1e-6), 100)
    opt_state = tx.init(params)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        params, opt_state, metrics = rl_step(graphdef, tx, params, opt_state, batch, ref,
                                             options=options, micro_batch=micro_batch)
        jax.block_until_ready(metrics)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--groups", type=int, default=1, help="groups per step")
    ap.add_argument("--attention", default="xla", help="model.attention_backend (auto, xla, pallas)")
    ap.add_argument("--layers", type=int, default=0, help="override the model's layer count")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    cfg = dataclasses.replace(MODELS[args.model], attention_backend=args.attention)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)

    rng = np.random.default_rng(0)
    prompts, completions = [], []
    for _ in range(args.groups):
        prompt = rng.integers(1, cfg.vocab_size, args.prompt).tolist()
        for _ in range(args.group):
            prompts.append(prompt)
            completions.append(rng.integers(1, cfg.vocab_size, args.completion).tolist())
    logprobs = [[-1.0] * len(c) for c in completions]
    advantages = rng.standard_normal(len(prompts))
    batches = {"unshared": pack(prompts, completions, logprobs, advantages, bucket=128),
               "shared": pack_shared(prompts, completions, logprobs, advantages,
                                     group_size=args.group, bucket=128)}

    print(f"{platform.node()} {jax.devices()[0].device_kind} jax {jax.__version__} "
          f"{datetime.date.today()}; model {args.model} ({cfg.num_layers} layers), prompt {args.prompt}, G {args.group}, "
          f"completion {args.completion}, {args.groups} group(s), attention {args.attention}")
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    results = {}
    for name, batch in batches.items():
        results[name] = time_steps(graphdef, params, batch, args.warmup, args.steps)
        tokens = int(np.prod(batch.tokens.shape))
        print(f"{name:>9}: {results[name] * 1e3:9.1f} ms/step  ({tokens} input tokens)")
    ideal = (args.group * (args.prompt + args.completion)) / (args.prompt + args.group * args.completion)
    print(f"speedup: {results['unshared'] / results['shared']:.2f}  (token ratio {ideal:.2f})")


if __name__ == "__main__":
    main()
