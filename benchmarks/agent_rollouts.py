"""Multi-turn agent rollouts: incremental prefill (`Continuation`: each turn prefills only the
appended observation onto the kept KV cache) vs re-prefilling the whole history every turn
(`Sampler.generate` on the full context), side by side on one random model.

Episodes are synthetic so that only the policy's sampling is timed: a prompt of `prompt`
tokens, then per turn an action of exactly `action` tokens (greedy, no stop token) and an
observation of `obs-min` to `obs` random tokens (uneven, as tools' outputs are: the rows'
shared write index pads the shorter ones). Also the one-thread continuation without packing
(`Unpacked`: the padding left in the cache, rebuilt at its bound; the baseline of packing).
Every path runs the same episodes once to compile, then once timed.

    PYTHONPATH=. python benchmarks/agent_rollouts.py          # CPU-sized model
    PYTHONPATH=. python benchmarks/agent_rollouts.py --size 100m --episodes 16 --turns 8
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import jax
import numpy as np

from jaxagent.models import init_model
from jaxagent.models.config import ModelConfig
from rollouts.sampler import Continuation, Sampler, continuation

SIZES = {
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16),
    "100m": ModelConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                        num_heads=12, num_kv_heads=4, head_dim=64),
}


class Unpacked(Continuation):
    """A continuation that leaves the shared index's padding in its cache (before packing)."""

    def _pack(self, needed: int) -> None:
        pass


def episodes(n, turns, prompt, obs, obs_min, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return ([rng.integers(1, vocab, prompt).tolist() for _ in range(n)],
            [[rng.integers(1, vocab, rng.integers(obs_min, obs + 1)).tolist() for _ in range(turns)]
             for _ in range(n)])


def run_incremental(sampler, prompts, observations, action, make=continuation):
    """`make`: continuation (CPU: slots split over host threads), Continuation (one thread) or
    Unpacked."""
    cont = make(sampler, slots=len(prompts), max_new_tokens=action, temperature=0.0)
    for slot, p in enumerate(prompts):
        cont.start(slot, p)
    tokens = 0
    for turn in range(len(observations[0])):
        out = cont.turn()
        tokens += sum(len(t) for t, _, _ in out.values())
        for slot in out:
            cont.append(slot, observations[slot][turn])
    return tokens, cont.stats["prefill_tokens"]


def run_reprefill(sampler, prompts, observations, action):
    histories = [list(p) for p in prompts]
    tokens = prefilled = 0
    for turn in range(len(observations[0])):
        out = sampler.generate(histories, max_new_tokens=action, temperature=0.0)
        tokens += sum(map(len, out.tokens))
        prefilled += sum(map(len, histories))
        for i, t in enumerate(out.tokens):
            histories[i] += t + observations[i][turn]
    return tokens, prefilled


def timed(fn, *args):
    fn(*args)  # compile every shape on the way
    t0 = time.perf_counter()
    tokens, prefilled = fn(*args)
    return time.perf_counter() - t0, tokens, prefilled


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--obs", type=int, default=192)
    ap.add_argument("--obs-min", type=int, default=None, help="default: obs // 4")
    ap.add_argument("--action", type=int, default=48)
    args = ap.parse_args()
    obs_min = args.obs // 4 if args.obs_min is None else args.obs_min
    cfg = SIZES[args.size]
    model = init_model(cfg, seed=0)
    sampler = Sampler(model, prompt_bucket=64, cache_bucket=512, batch_bucket=8, segment_steps=32)
    prompts, obs = episodes(args.episodes, args.turns, args.prompt, args.obs, obs_min,
                            cfg.vocab_size)
    print(f"# {jax.devices()[0].device_kind} ({platform.node()}), model {args.size}, "
          f"{args.episodes} episodes x {args.turns} turns, prompt {args.prompt}, "
          f"obs {obs_min}-{args.obs}, action {args.action} tokens")
    rows = {}
    for name, fn in [("incremental", run_incremental),
                     ("incr, 1 thread", functools.partial(run_incremental, make=Continuation)),
                     ("incr, unpacked", functools.partial(run_incremental, make=Unpacked)),
                     ("re-prefill", run_reprefill)]:
        seconds, tokens, prefilled = timed(fn, sampler, prompts, obs, args.action)
        turns = args.episodes * args.turns
        rows[name] = seconds
        print(f"{name:14s} {seconds:8.3f} s  {turns / seconds:8.2f} turns/s  "
              f"{tokens / seconds:9.1f} policy tokens/s  prefilled {prefilled} tokens")
    print(f"speed-up (re-prefill time / incremental time): {rows['re-prefill'] / rows['incremental']:.2f}x; "
          f"host threads: {rows['incr, 1 thread'] / rows['incremental']:.2f}x; packing "
          f"(unpacked / 1 thread): {rows['incr, unpacked'] / rows['incr, 1 thread']:.2f}x")


if __name__ == "__main__":
    main()
