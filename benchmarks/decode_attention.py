"""A decode step's attention on the sampler's cache, in the forms XLA can be given: the
production multiply-and-reduce (``_decode_attention``: XLA:CPU's fastest) against einsum dots
(cuBLAS/Triton GEMMs on a GPU), per layer, at the Qwen2.5-0.5B head layout.

    python benchmarks/decode_attention.py --jsonl out.jsonl     # GPU: batch 1, 16, 64

Letters: B batch, K kv heads, G query heads per kv head, S cache slots, H head dim, L layers.
One jitted program runs L layers' attention (each its own K/V, as in a decode step), so the
per-layer time includes each kernel's fixed cost; best of `--repeats` after a compiling call.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.doc_attention.xla import _decode_attention


def dot_form(q, k, v, mask):
    """q [B, 1, N, H], k and v [B, K, S, H], mask [B, 1, S] -> [B, 1, N, H], as dots."""
    b, _, n, h = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("BKGH,BKSH->BKGS", q, k, preferred_element_type=jnp.float32) * h**-0.5
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BKGS,BKSH->BKGH", probs.astype(v.dtype), v)
    return out.reshape(b, 1, n, h)


FORMS = {"reduce": _decode_attention, "dot": dot_form}


def time_form(form, batch, slots, layers, heads, kv_heads, head_dim, filled, repeats):
    rng = np.random.default_rng(0)
    bf16 = jnp.bfloat16
    q = jnp.asarray(rng.standard_normal((layers, batch, 1, heads, head_dim)), bf16)
    k, v = (jnp.asarray(rng.standard_normal((layers, batch, kv_heads, slots, head_dim)), bf16)
            for _ in range(2))
    mask = jnp.asarray(np.arange(slots)[None, None, :] < filled).repeat(batch, 0)

    @jax.jit
    def run(q, k, v):
        return sum(FORMS[form](q[i], k[i], v[i], mask).astype(jnp.float32).sum()
                   for i in range(layers))

    run(q, k, v).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(q, k, v).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    want = _decode_attention(q[0], k[0], v[0], mask).astype(jnp.float32)
    err = float(jnp.abs(FORMS[form](q[0], k[0], v[0], mask).astype(jnp.float32) - want).max())
    return best / layers, err


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--slots", type=int, default=640, help="cache bucket (prompt 512 + 128 new)")
    p.add_argument("--filled", type=int, default=576, help="slots written (the mean length)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--jsonl", type=Path)
    args = p.parse_args()
    device = jax.devices()[0]
    print(f"# {time.strftime('%Y-%m-%d')} {device.platform} {device.device_kind} jax {jax.__version__}")
    print("| batch | " + " | ".join(f"{f} µs/layer" for f in FORMS) + " | reduce/dot |")
    print("|---" * (len(FORMS) + 2) + "|")
    for batch in args.batches:
        row = {}
        for form in FORMS:
            sec, err = time_form(form, batch, args.slots, args.layers, args.heads, args.kv_heads,
                                 args.head_dim, args.filled, args.repeats)
            row[form] = sec
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps(dict(kind="decode_attention", form=form, batch=batch,
                                            slots=args.slots, device=device.device_kind,
                                            us_per_layer=sec * 1e6, max_abs_err=err)) + "\n")
        print(f"| {batch} | " + " | ".join(f"{row[f] * 1e6:.1f}" for f in FORMS)
              + f" | {row['reduce'] / row['dot']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
