"""Train-step time with one row per rollout (padded) vs rows packed by token budget, side by
side in one run.

Padded (`jaxagent.steps.pack`), each of a batch's rollouts is a row right-padded to the longest,
so a batch of agent episodes of 500-3000 tokens is ~40% padding. Packed (`pack_budget`,
`train.pack_tokens`), rollouts share rows of `--pack-tokens` tokens as documents (own segment
ids, positions from 0), first fit by decreasing length, the rows rounded up as the learner
rounds them on one device. Same loss and gradients
(tests/jaxagent/test_steps.py).

    python benchmarks/packing.py                                  # 32 episodes of 500-3000
    python benchmarks/packing.py --min-len 125 --max-len 750 --pack-tokens 768   # a quarter

Episodes: a prompt of 200-400 tokens, then turns of an action (policy mask 1, 30-120 tokens)
and a tool observation (mask 0, 50-400 tokens) up to a length drawn uniformly from
[--min-len, --max-len]. Timed: one jitted `rl_step` (forward, backward, AdamW update) with a
KL and an entropy term, `--warmup` untimed steps (compilation) then the median of `--steps`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform

import jax
import numpy as np
from flax import nnx

from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from jaxagent.steps import LossOptions, pack, pack_budget
from jaxagent.train.loop import PACKED_ROW_BUCKET
from shared_prompt import time_steps  # run as a script: benchmarks/ is on the path


def episodes(n: int, low: int, high: int, vocab: int, seed: int = 0):
    """(prompts, completions, policy masks, behaviour log-probs) of `n` agent-like episodes."""
    rng = np.random.default_rng(seed)
    prompts, completions, masks = [], [], []
    for _ in range(n):
        total = int(rng.integers(low, high + 1))
        prompt = int(min(rng.integers(200, 401), total // 4))
        mask = []
        while len(mask) < total - prompt:
            mask += [1] * int(rng.integers(30, 121)) + [0] * int(rng.integers(50, 401))
        mask = mask[:total - prompt]
        prompts.append(rng.integers(1, vocab, prompt).tolist())
        completions.append(rng.integers(1, vocab, len(mask)).tolist())
        masks.append(mask)
    logprobs = [(-5.6 + 0.3 * rng.standard_normal(len(c))).tolist() for c in completions]
    return prompts, completions, masks, logprobs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=500)
    ap.add_argument("--max-len", type=int, default=3000)
    ap.add_argument("--pack-tokens", type=int, default=3072, help="train.pack_tokens")
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="train.micro_batch: rollouts a micro-batch padded, rows packed")
    ap.add_argument("--attention", default="xla", help="model.attention_backend")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    cfg = dataclasses.replace(ModelConfig(), attention_backend=args.attention)

    prompts, completions, masks, logprobs = episodes(args.episodes, args.min_len, args.max_len,
                                                     cfg.vocab_size)
    advantages = np.random.default_rng(1).standard_normal(args.episodes)
    args_ = (prompts, completions, logprobs, advantages)
    batches = {"padded": pack(*args_, completion_masks=masks),
               "packed": pack_budget(*args_, budget=args.pack_tokens, completion_masks=masks,
                                     row_multiple=math.lcm(args.micro_batch or 1,
                                                           PACKED_ROW_BUCKET))}
    options = LossOptions(kl_coef=0.01, entropy_coef=0.001)

    real = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    print(f"{platform.node()} {jax.devices()[0].device_kind} jax {jax.__version__} "
          f"{datetime.date.today()} load {os.getloadavg()[0]:.1f}; tiny model "
          f"({cfg.num_layers} layers, d {cfg.hidden_size}), {args.episodes} episodes of "
          f"{args.min_len}-{args.max_len} tokens ({real} in all), pack_tokens "
          f"{args.pack_tokens}, micro_batch {args.micro_batch}, attention {args.attention}")
    graphdef, params = nnx.split(init_model(cfg, seed=0))
    seconds = {}
    for name, batch in batches.items():
        seconds[name] = time_steps(graphdef, params, batch, args.warmup, args.steps,
                                   options=options, micro_batch=args.micro_batch)
        rows, width = batch.tokens.shape
        print(f"{name:>7}: {rows:3d} rows x {width} = {rows * width:7d} tokens, padding "
              f"{1 - real / (rows * (width + 1)):5.1%}, {seconds[name]:8.2f} s/step")
    print(f"speed-up: {seconds['padded'] / seconds['packed']:.2f}x")


if __name__ == "__main__":
    main()
