"""NSA's top-n block selection (eqs. 11-12) in the forms XLA can be given, on the layer's
importance scores [B, T, K, P]: the fifth H200 lease's 64k profile had `lax.top_k` over all T
rows as one 6 ms kernel (XLA's TopK custom kernel, 19% of the Mosaic layer's forward), while the
XLA layer's top-n over 1,024-query chunks ran as sorts of 22 us each (1.4 ms in all).

    python benchmarks/top_n.py --seq 16384 65536 --jsonl out.jsonl

Letters: T queries, K kv heads, P selection blocks (T / 64), J selected (16). Forms:
  top_k       lax.top_k over every row at once (`xla.top_n`'s "top_k", CPU and TPU)
  top_k_1024  lax.top_k in chunks of 1,024 rows (lax.map)
  sort        a stable sort of (-score, block) per row, first J kept
  argmax      J rounds of argmax, each taking its block out (`xla.top_n`'s "argmax", GPUs)
Every form's indices must equal top_k's (ties to the lower block); best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.nsa import xla as X


def top_k(score, j):
    return X.top_n(score, j, "top_k")[1]


def top_k_chunked(score, j, rows=1024):
    t = score.shape[0]
    chunks = score.reshape(t // rows, rows, *score.shape[1:])
    return jax.lax.map(lambda c: jax.lax.top_k(c, j)[1], chunks).reshape(t, *score.shape[1:-1], j)


def by_sort(score, j):
    block = jax.lax.broadcasted_iota(jnp.int32, score.shape, score.ndim - 1)
    _, idx = jax.lax.sort((-score, block), dimension=score.ndim - 1, is_stable=True, num_keys=1)
    return idx[..., :j]


def by_argmax(score, j):
    return X.top_n(score, j, "argmax")[1]


FORMS = {"top_k": top_k, "top_k_1024": top_k_chunked, "sort": by_sort, "argmax": by_argmax}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--select-block", type=int, default=64)
    p.add_argument("--selected", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--jsonl", type=Path)
    args = p.parse_args()
    dev = jax.devices()[0]
    print(f"# {time.strftime('%Y-%m-%d')} {dev.device_kind}, jax {jax.__version__}")
    for t in args.seq:
        blocks = t // args.select_block
        rng = np.random.default_rng(t)
        # future blocks at -inf and forced ones at +inf, as top_blocks hands them over
        own = np.arange(t)[:, None, None] // args.select_block
        score = rng.random((t, args.kv_heads, blocks), np.float32)
        score = np.where(np.arange(blocks) > own, -np.inf, score)
        score = np.where(np.arange(blocks) == 0, np.inf, score)
        score = jnp.asarray(score)
        want = np.asarray(top_k(score, args.selected))
        for name, form in FORMS.items():
            run = jax.jit(form, static_argnums=1)
            got = np.asarray(run(score, args.selected))
            # rows with fewer than J past blocks tie at -inf: top_blocks turns those slots into
            # -1, so only the finite picks have to agree
            finite = np.take_along_axis(np.asarray(score), want, -1) > -np.inf
            same = bool(np.array_equal(np.where(finite, got, -1), np.where(finite, want, -1)))
            best = float("inf")
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                run(score, args.selected).block_until_ready()
                best = min(best, time.perf_counter() - t0)
            row = {"date": time.strftime("%Y-%m-%d"), "device": dev.device_kind, "jax": jax.__version__,
                   "seq": t, "blocks": blocks, "form": name, "ms": best * 1e3, "same_as_top_k": same}
            print(f"T={t:6d} P={blocks:5d} {name:11s} {best * 1e3:8.3f} ms  same: {same}")
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
