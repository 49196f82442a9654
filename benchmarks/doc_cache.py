"""Time to first token of a document prompt with 0%, 50%, 100% of its documents' KVs cached
(`rollouts/kv_store.py`), against a full prefill of the same tokens, in one run.

    python benchmarks/doc_cache.py                                   # 8 x 2048-token documents
    python benchmarks/doc_cache.py --model tiny --doc-len 256        # CPU-sized

Ours: `Sampler.generate([final], documents=[docs], max_new_tokens=1)`: the cached documents'
KVs are read from the store, the others encoded alone (one batched prefill), then the final
section is prefilled onto them. Baseline: the plain path, `generate([docs... + final])`, one
causal prefill of every token. Each timed call uses fresh random tokens for the uncached
documents (real misses) and the same shapes (no compilation after `--warmup`); the median of
`--reps` is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import time

import jax
import numpy as np
from shared_prompt import MODELS

from jaxagent.models import init_model
from rollouts.sampler import Sampler


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--final", type=int, default=64, help="tokens of the prompt's own section")
    ap.add_argument("--attention", default="dense", choices=["dense", "doc"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=0, help="override the model's layer count")
    args = ap.parse_args()
    cfg = dataclasses.replace(MODELS[args.model], attention=args.attention)
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    rng = np.random.default_rng(0)

    def tokens(n):
        return rng.integers(1, cfg.vocab_size, n).tolist()

    sampler = Sampler(init_model(cfg, seed=0), prompt_bucket=64, batch_bucket=8)
    cached = [tokens(args.doc_len) for _ in range(args.docs)]
    sampler.generate([tokens(args.final)], documents=[cached], max_new_tokens=1)  # store them

    def ttft(prompt, documents=None):
        t0 = time.perf_counter()
        out = sampler.generate([prompt], documents=documents, max_new_tokens=1, temperature=0)
        return time.perf_counter() - t0, out.stats

    def run(fraction):
        n_cached = round((fraction or 0) * args.docs)
        times = []
        for i in range(args.warmup + args.reps):
            docs = cached[:n_cached] + [tokens(args.doc_len) for _ in range(args.docs - n_cached)]
            if fraction is None:  # the baseline: one prefill of everything
                seconds, stats = ttft(sum(docs, []) + tokens(args.final))
            else:
                seconds, stats = ttft(tokens(args.final), [docs])
            if i >= args.warmup:
                times.append(seconds)
        return statistics.median(times), stats

    device = jax.devices()[0]
    print(f"{platform.node()} {device.device_kind} jax {jax.__version__} {datetime.date.today()}; "
          f"model {args.model} ({cfg.num_layers} layers, attention {args.attention}), "
          f"{args.docs} docs x {args.doc_len} tokens + {args.final}, median of {args.reps}")
    baseline, _ = run(None)
    print("| documents cached | prefilled tokens | TTFT ms | vs full prefill |")
    print("|---|---|---|---|")
    print(f"| full prefill (no documents=) | {args.docs * args.doc_len + args.final} | "
          f"{baseline * 1e3:.1f} | 1.00x |")
    for fraction in (0.0, 0.5, 1.0):
        seconds, stats = run(fraction)
        print(f"| {fraction:.0%} | {stats['prefill_tokens']} | {seconds * 1e3:.1f} | "
              f"{baseline / seconds:.2f}x |")


if __name__ == "__main__":
    main()
