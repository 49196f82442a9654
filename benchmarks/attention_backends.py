"""The backends of `model.attention_backend` on causal rows, through the model's seam
(`pallas_kernels.attention.dense_attention`): xla, cudnn, pallas (the doc kernel) and splash,
forward and forward+backward, at the Qwen2.5-0.5B head layout (14 query heads, 2 kv heads, head
dim 64), batch 1, bfloat16. `xla-whole` is the xla backend with its queries all at once (no
`default_query_chunk()` chunks), the baseline of the chunking; `xla-cN` is the xla backend in
chunks of N queries, all reading every key (no causal bands: the baseline of the bands).

    python benchmarks/attention_backends.py --out /tmp/attention_backends.jsonl   # GPU: 4k-32k
    PYTHONPATH=. python benchmarks/attention_backends.py --seq 256                # CPU smoke run
    # CPU, the tiny agent model's heads on 4 episode rows: chunk sizes and whole XLA
    PYTHONPATH=. python benchmarks/attention_backends.py --seq 1024 3072 --batch 4 --heads 4 \
        --kv-heads 2 --head-dim 32 --dtype float32 --backends xla xla-c32 xla-c256 xla-whole --repeats 3

Each (backend, tokens, pass) is one JSON line in --out as soon as it exists: the best of
--repeats timed runs after a compile run, TFLOP/s (analytic: the causal half of the matmuls; the
backward counts 2.5x the forward, FlashAttention-2's convention with recomputation), and the
forward's largest difference from XLA's output where XLA ran, and the compiled program's
temporary memory (`temp_mib`, XLA's own count). A backend this platform lacks
(cudnn off a GPU, splash on one) or XLA whose float32 scores would not fit in memory is a line
with the reason it was skipped. On CPU, pallas and splash are interpreted: their times say
nothing about the kernels. The summary gives each time over cuDNN's (XLA's where cudnn did not
run).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention import dense_attention, resolve_backend
from pallas_kernels.doc_attention.xla import default_query_chunk, xla_attention

BACKENDS = ("xla", "xla-whole", "cudnn", "pallas", "splash")
PASSES = ("fwd", "fwd+bwd")
# f32 [chunk, T] buffers per query head XLA holds at once (scores, probabilities; gradients).
XLA_BUFFERS = {"fwd": 3, "fwd+bwd": 6}


def timed(fn, *args, repeats):
    """(the output, best seconds of `repeats` runs after a compile run)."""
    out = jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return out, best


def backend_arg(name: str) -> str:
    if name in BACKENDS or (name.startswith("xla-c") and name[5:].isdigit()):
        return name
    raise argparse.ArgumentTypeError(f"{name}: one of {', '.join(BACKENDS)} or xla-cN")


def query_chunk(backend: str) -> int | None:
    """The xla variants' queries per chunk (0: whole; None: the default), else None."""
    return 0 if backend == "xla-whole" else int(backend[5:]) if backend.startswith("xla-c") else None


def programs(backend):
    """(forward, forward+backward) jitted for `backend` on causal rows."""

    def attend(q, k, v, seg, slots):
        ids = dict(q_segment_ids=seg, kv_segment_ids=seg, q_slots=slots, kv_slots=slots)
        if backend.startswith("xla-"):
            return xla_attention(q, k, v, **ids, query_chunk=query_chunk(backend))
        return dense_attention(q, k, v, **ids, backend=backend, rows="causal")

    def forward_backward(q, k, v, seg, slots, do):
        _, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, seg, slots), q, k, v)
        return vjp(do)

    return {"fwd": jax.jit(attend), "fwd+bwd": jax.jit(forward_backward)}


def why_not(backend, t, n, dtype, which):
    """The reason `backend` cannot run here at `t` tokens, or None."""
    try:
        resolve_backend("dense", backend.split("-")[0], rows="causal", dtype=dtype)
    except ValueError as e:
        return str(e)
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    chunk = query_chunk(backend)
    chunk = default_query_chunk() if chunk is None else chunk or t
    need = XLA_BUFFERS[which] * n * min(t, chunk) * t * 4
    if backend.startswith("xla") and limit and need > limit:
        return f"XLA's float32 scores would take ~{need / 2**30:.0f} GiB of {limit / 2**30:.0f}"
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    on_cpu = jax.default_backend() == "cpu"
    ap.add_argument("--seq", type=int, nargs="+", default=[256] if on_cpu else [4096, 8192, 16384, 32768])
    ap.add_argument("--backends", nargs="+", type=backend_arg, default=list(BACKENDS),
                    help=f"of {', '.join(BACKENDS)}, or xla-cN: xla in chunks of N queries")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--repeats", type=int, default=1 if on_cpu else 5)
    ap.add_argument("--out", default=None, help="append the results here, one JSON line each")
    args = ap.parse_args()
    b, n, kh, h, dtype = args.batch, args.heads, args.kv_heads, args.head_dim, jnp.dtype(args.dtype)
    common = {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
              "jax": jax.__version__, "batch": b, "heads": n, "kv_heads": kh, "head_dim": h,
              "dtype": dtype.name}
    runs = {backend: programs(backend) for backend in args.backends}
    times = {}
    for t in args.seq:
        rng = np.random.default_rng(t)
        q, do = (jnp.asarray(rng.standard_normal((b, t, n, h)), dtype) for _ in range(2))
        k, v = (jnp.asarray(rng.standard_normal((b, kh, t, h)), dtype) for _ in range(2))
        seg = jnp.ones((b, t), jnp.int32)
        slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        forward_flops = 4 * b * n * t * t * h / 2
        reference = None
        for which in PASSES:
            for backend in args.backends:
                row = dict(common, backend=backend, tokens=t, **{"pass": which})
                reason = why_not(backend, t, n, dtype, which)
                if reason is None:
                    inputs = (q, k, v, seg, slots) + ((do,) if which == "fwd+bwd" else ())
                    try:
                        program = runs[backend][which]
                        temp = program.lower(*inputs).compile().memory_analysis()
                        out, seconds = timed(program, *inputs, repeats=args.repeats)
                    except jax.errors.JaxRuntimeError as e:  # out of memory the estimate let through
                        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if reason is not None:
                    row["skipped"] = reason
                else:
                    flops = forward_flops * (1 if which == "fwd" else 3.5)
                    row.update(ms=round(seconds * 1e3, 3), tflops=round(flops / seconds / 1e12, 2),
                               interpreted=on_cpu and backend in ("pallas", "splash"),
                               temp_mib=temp and round(temp.temp_size_in_bytes / 2**20, 1))
                    times[t, which, backend] = seconds
                    if which == "fwd" and backend == "xla":
                        reference = out
                    elif which == "fwd" and reference is not None:
                        row["max_abs_diff_vs_xla"] = float(jnp.max(jnp.abs(
                            out.astype(jnp.float32) - reference.astype(jnp.float32))))
                print(json.dumps(row), flush=True)
                if args.out:  # line by line: a run cut short keeps what it measured
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print("\nms (x the baseline: cudnn where it ran, else xla)")
    for t in args.seq:
        for which in PASSES:
            ran = {bk: times[t, which, bk] for bk in args.backends if (t, which, bk) in times}
            base = ran.get("cudnn", ran.get("xla"))
            cells = [f"{bk} {s * 1e3:.2f}" + (f" ({s / base:.2f}x)" if base else "")
                     for bk, s in ran.items()]
            print(f"{t:>6} {which:<8} " + ", ".join(cells or ["nothing ran"]))


if __name__ == "__main__":
    main()
