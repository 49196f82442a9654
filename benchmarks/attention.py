"""NSA vs dense causal attention: forward, forward+backward and one decode step, side by side.

    PYTHONPATH=. python benchmarks/attention.py            # CPU: 16k, compiled plain-JAX NSA vs XLA dense
    python benchmarks/attention.py --seq 8192 16384 32768 65536 --heads 16 --kv-heads 1 --head-dim 128

On GPU the dense baselines are `jax.nn.dot_product_attention` (cuDNN) and the Pallas Triton
flash kernel (`jax.experimental.pallas.ops.gpu.attention.mha`); `nsa_layer` is the layer as
the model runs it (`pallas_kernels.nsa.nsa_attention`, `kernels: auto`: on Hopper the Mosaic
selected and compressed kernels and cuDNN's sliding window), `nsa_layer_triton` the Triton
selected-block kernel, cuDNN's window and the compressed branch in XLA (the default before
2026-11-28), `nsa_layer_kernels` all three Triton kernels; each branch is also timed alone,
kernel vs XLA/cuDNN (`nsa_compressed_*` includes the compression MLPs and the top-n, which on a
GPU takes rounds of argmax), and `nsa_selected_mosaic` / `nsa_window_mosaic` / `nsa_compressed_mosaic` are those
branches on the Hopper (Mosaic GPU) kernels, `nsa_layer_mosaic` all three. On CPU both sides are compiled XLA: dense `dot_product_attention` vs the chunked
plain-JAX NSA (`nsa_forward`: gathered selected blocks, banded window). Each number is the best
of --repeats timed runs after a compile run; FLOP counts are analytic (matmuls only, causal
halves).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.nsa import (
    compressed_attention,
    nsa_attention,
    select_attention,
    select_mgpu,
    sliding_window_attention,
)
from pallas_kernels.nsa import reference as R
from pallas_kernels.nsa import xla as X
from pallas_kernels.nsa._index import clean_block_idx
from pallas_kernels.nsa.attention import sliding_window_cudnn
from pallas_kernels.nsa.compressed_gpu import BlockSizes as CompressedBlockSizes
from pallas_kernels.nsa.compressed_gpu import compressed_attention_gpu
from pallas_kernels.nsa.select_gpu import BlockSizes as SelectBlockSizes
from pallas_kernels.nsa.select_gpu import select_attention_gpu
from pallas_kernels.nsa.window_gpu import BlockSizes as WindowBlockSizes
from pallas_kernels.nsa.window_gpu import sliding_window_attention_gpu


def timed(fn, *args, repeats):
    jax.block_until_ready(fn(*args))  # compile + warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def random_selection(key, b, t, kh, shape: X.NSAShape):
    """Plausible block lists without the O(T * S) scoring: block 0, the local blocks and random
    past blocks (repeats are dropped by the kernel)."""
    own = jnp.arange(t)[None, :, None, None] // shape.select_block
    rand = jax.random.randint(key, (b, t, kh, shape.num_selected - 1 - shape.num_local_blocks), 0, 1 << 30) % (own + 1)
    local = own - jnp.arange(shape.num_local_blocks)
    zero = jnp.zeros_like(own)
    return jnp.concatenate([zero, jnp.broadcast_to(local, (b, t, kh, shape.num_local_blocks)), rand], -1).astype(jnp.int32)


def block_loads(idx, groups, shape: X.NSAShape):
    """Key/value block loads of the selected branch: the per-position kernels load every pick of
    every position; the Mosaic GPU kernels load each block of a tile's union once."""
    t = idx.shape[1]
    clean = clean_block_idx(idx, block_size=shape.select_block, s_len=t, causal=True)
    r = select_mgpu.ROWS // select_mgpu.group_rows(groups)
    per_position = int(jnp.sum(clean >= 0))
    clean = jnp.pad(clean, ((0, 0), (0, -t % r), (0, 0), (0, 0)), constant_values=-1)
    _, _, count = select_mgpu.union_blocks(clean, r, -(-t // shape.select_block))
    union = int(jnp.sum(count))
    return {"positions_per_tile": r, "per_position": per_position, "union": union, "ratio": per_position / union}


def flops(t, n, h, shape: X.NSAShape):
    """Forward matmul FLOPs: dense causal vs NSA's three branches (+ the compression MLP)."""
    dense = 2 * 2 * n * h * t * t / 2
    c = t // shape.compress_stride
    cmp = 2 * 2 * n * h * t * c / 2
    slc = 2 * 2 * n * h * t * min(shape.num_selected * shape.select_block, t / 2)
    win = 2 * 2 * n * h * t * min(shape.window, t / 2)
    mlp = 2 * 2 * c * shape.compress_block * h * h  # k and v, hidden = h, per kv head (lower bound)
    return dense, cmp + slc + win + mlp


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    on_gpu = jax.default_backend() == "gpu"
    ap.add_argument("--seq", type=int, nargs="+", default=[16384])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16 if on_gpu else 2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128 if on_gpu else 64)
    ap.add_argument("--repeats", type=int, default=5 if on_gpu else 1)
    ap.add_argument("--skip", nargs="*", default=[], help="case names to skip")
    ap.add_argument("--only", nargs="*", default=None, help="only these case names")
    ap.add_argument("--no-backward", action="store_true", help="forward only (CPU: dense fwd+bwd at 16k takes minutes)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--trace", default=None, help="a perfetto trace of each case's timed "
                    "forward calls goes under this folder (benchmarks/trace_kernels.py sums it)")
    args = ap.parse_args()
    shape = X.NSAShape()  # the paper's l=32, d=16, l'=64, n=16, w=512
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    b, n, kh, h = args.batch, args.heads, args.kv_heads, args.head_dim
    results = {
        "device": str(jax.devices()[0].device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "host": platform.node(),
        "shape": {"batch": b, "heads": n, "kv_heads": kh, "head_dim": h, "dtype": jnp.dtype(dtype).name},
        "rows": [],
    }
    params = jax.tree.map(lambda x: x.astype(dtype), R.init_nsa_params(jax.random.key(0), shape, n, h))

    for t in args.seq:
        ks = jax.random.split(jax.random.key(t), 5)
        q = jax.random.normal(ks[0], (b, t, n, h), dtype)
        k = jax.random.normal(ks[1], (b, t, kh, h), dtype)
        v = jax.random.normal(ks[2], (b, t, kh, h), dtype)
        do = jax.random.normal(ks[3], (b, t, n, h), dtype)
        idx = random_selection(ks[4], b, t, kh, shape)

        def compressed(q, k, v, compressed_fn=None):
            """The compressed branch and the selection it drives, from the keys (MLPs included)."""
            kc, vc = X.compress_blocks(k, params["compress_k"], shape), X.compress_blocks(v, params["compress_v"], shape)
            return X.compressed_branch(q, kc, vc, shape, -(-t // shape.select_block), h**-0.5, compressed_fn,
                                       top_n_form="argmax" if on_gpu else "top_k")

        cases = {"nsa_compressed_xla": lambda q, k, v, idx: compressed(q, k, v)}
        if on_gpu:
            from jax.experimental.pallas.ops.gpu import attention as flash

            cases["dense_cudnn"] = lambda q, k, v, idx: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
            cases["dense_pallas_flash"] = lambda q, k, v, idx: flash.mha(
                q, jnp.repeat(k, n // kh, 2), jnp.repeat(v, n // kh, 2), None, sm_scale=h**-0.5, causal=True
            )
            triton = dict(gpu_kernels="triton")
            cases["nsa_selected_kernel"] = lambda q, k, v, idx: select_attention(
                q, k, v, idx, block_size=shape.select_block, **triton)
            cases["nsa_layer"] = lambda q, k, v, idx: nsa_attention(q, k, v, params, shape)
            cases["nsa_layer_triton"] = lambda q, k, v, idx: X.nsa_forward(
                q, k, v, params, shape, select_fn=functools.partial(select_attention, **triton),
                window_fn=sliding_window_cudnn,
            )
            # the window branch alone: our Pallas kernel vs cuDNN's sliding window
            cases["nsa_window_kernel"] = lambda q, k, v, idx: sliding_window_attention(q, k, v, window=shape.window, **triton)
            cases["nsa_window_cudnn"] = lambda q, k, v, idx: sliding_window_cudnn(q, k, v, window=shape.window, scale=h**-0.5)
            cases["nsa_compressed_kernel"] = lambda q, k, v, idx: compressed(
                q, k, v, functools.partial(compressed_attention, **triton))
            cases["nsa_layer_kernels"] = lambda q, k, v, idx: nsa_attention(
                q, k, v, params, shape, kernels="all", gpu_kernels="triton")
            # the Hopper kernels (Mosaic GPU: TMA + wgmma over a tile's block union); last, as they
            # have not run on hardware yet and a fault must not take the others with it
            mosaic = {
                "select_fn": functools.partial(select_attention_gpu, block_sizes=SelectBlockSizes(backend="mosaic")),
                "window_fn": functools.partial(sliding_window_attention_gpu, block_sizes=WindowBlockSizes(backend="mosaic")),
                "compressed_fn": functools.partial(compressed_attention_gpu, block_sizes=CompressedBlockSizes(backend="mosaic")),
            }
            cases["nsa_selected_mosaic"] = lambda q, k, v, idx: mosaic["select_fn"](q, k, v, idx, block_size=shape.select_block)
            cases["nsa_window_mosaic"] = lambda q, k, v, idx: mosaic["window_fn"](q, k, v, window=shape.window)
            cases["nsa_compressed_mosaic"] = lambda q, k, v, idx: compressed(q, k, v, mosaic["compressed_fn"])
            cases["nsa_layer_mosaic"] = lambda q, k, v, idx: X.nsa_forward(q, k, v, params, shape, **mosaic)
        else:
            cases["dense_xla"] = lambda q, k, v, idx: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
            cases["nsa_selected_gathered"] = lambda q, k, v, idx: X.select_attention_gathered(
                q, k, v, idx, block_size=shape.select_block
            )
            cases["nsa_layer"] = lambda q, k, v, idx: X.nsa_forward(q, k, v, params, shape)

        dense_f, nsa_f = flops(t, n, h, shape)
        row = {"seq": t, "dense_gflop": dense_f / 1e9, "nsa_gflop": nsa_f / 1e9, "ms": {},
               "mosaic_block_loads": block_loads(idx, n // kh, shape)}
        for name, fn in cases.items():
            if name in args.skip or (args.only is not None and name not in args.only):
                continue
            fwd = jax.jit(fn)
            # idx is an argument, not a constant: the CSR inversion is timed, not constant-folded.
            # A case may return (out, block_idx): the selection is returned too, so it is not dead code.
            @jax.jit
            def fwdbwd(q, k, v, idx, fn=fn, do=do):
                split = lambda out: out if isinstance(out, tuple) else (out, ())
                _, back, aux = jax.vjp(lambda q, k, v: split(fn(q, k, v, idx)), q, k, v, has_aux=True)
                return back(do), aux

            for kind, f in (("fwd", fwd), ("fwd+bwd", fwdbwd))[: 1 if args.no_backward else 2]:
                try:
                    row["ms"][f"{name}/{kind}"] = 1e3 * timed(f, q, k, v, idx, repeats=args.repeats)
                    if args.trace and kind == "fwd":
                        with jax.profiler.trace(f"{args.trace}/{t}-{name}", create_perfetto_trace=True):
                            jax.block_until_ready(f(q, k, v, idx))
                except Exception as e:  # noqa: BLE001  a missing backend (cuDNN, Triton) must not hide the others
                    row["ms"][f"{name}/{kind}"] = f"error: {type(e).__name__}: {str(e)[:200]}"
                print(t, name, kind, row["ms"][f"{name}/{kind}"], flush=True)

        # one decode step at position t-1 with a full cache
        k_cmp = X.compress_blocks(k, params["compress_k"], shape)
        v_cmp = X.compress_blocks(v, params["compress_v"], shape)
        q1 = q[:, -1:]
        pos = jnp.full((b,), t - 1)
        dense_dec = jax.jit(lambda q1, k, v: jax.nn.dot_product_attention(q1, k, v, implementation="xla"))
        nsa_dec = jax.jit(lambda q1, k, v, kc, vc, pos: X.nsa_decode_step(q1, k, v, kc, vc, pos, params, shape))
        k_slots, v_slots, kc, vc = (x.transpose(0, 2, 1, 3) for x in (k, v, k_cmp, v_cmp))  # a sampler cache's layout
        for name, f, a in (("dense/decode", dense_dec, (q1, k, v)),
                           ("nsa/decode", nsa_dec, (q1, k_slots, v_slots, kc, vc, pos))):
            try:
                row["ms"][name] = 1e3 * timed(f, *a, repeats=max(args.repeats, 5))
            except Exception as e:  # noqa: BLE001
                row["ms"][name] = f"error: {type(e).__name__}: {str(e)[:200]}"
            print(t, name, row["ms"][name], flush=True)
        results["rows"].append(row)
        if args.out:  # after every length, so a run cut by its time budget keeps what it measured
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    print(json.dumps(results, indent=1))
    for row in results["rows"]:
        ms = row["ms"]
        dense = "dense_cudnn" if on_gpu else "dense_xla"
        print(f"T={row['seq']}: FLOP ratio dense/NSA = {row['dense_gflop'] / row['nsa_gflop']:.2f}")
        loads = row["mosaic_block_loads"]
        print(f"  selected-branch key/value block loads, one per position's pick / one per tile union "
              f"(R={loads['positions_per_tile']}) = {loads['ratio']:.2f}x")
        for kind in ("fwd", "fwd+bwd"):
            for nsa in ("nsa_selected_kernel", "nsa_selected_gathered", "nsa_layer", "nsa_layer_triton",
                        "nsa_layer_kernels", "nsa_layer_mosaic"):
                a, c = ms.get(f"{dense}/{kind}"), ms.get(f"{nsa}/{kind}")
                if isinstance(a, float) and isinstance(c, float):
                    print(f"  {kind:8s} {dense} / {nsa} = {a / c:.2f}x ({a:.2f} ms vs {c:.2f} ms)")
            for branch in ("selected", "window", "compressed"):
                a, c = ms.get(f"nsa_{branch}_kernel/{kind}"), ms.get(f"nsa_{branch}_mosaic/{kind}")
                if isinstance(a, float) and isinstance(c, float):
                    print(f"  {kind:8s} {branch} branch Triton / Mosaic GPU = {a / c:.2f}x ({a:.2f} ms vs {c:.2f} ms)")
            a, c = ms.get(f"nsa_compressed_xla/{kind}"), ms.get(f"nsa_compressed_kernel/{kind}")
            if isinstance(a, float) and isinstance(c, float):
                print(f"  {kind:8s} compressed branch XLA / kernel = {a / c:.2f}x ({a:.2f} ms vs {c:.2f} ms)")
        a, c = ms.get("dense/decode"), ms.get("nsa/decode")
        if isinstance(a, float) and isinstance(c, float):
            print(f"  decode   dense / nsa = {a / c:.2f}x ({a:.3f} ms vs {c:.3f} ms)")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
