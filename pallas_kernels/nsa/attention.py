"""NSA's public entry points: ``nsa_attention`` (the layer) and the validated branch kernels
(``select_attention``, ``sliding_window_attention``, ``compressed_attention``). Which kernel runs
is decided here only: ``branch_kernels`` turns ``kernels`` into the branches that run as Pallas
kernels (the rest stay XLA, ``xla.py``), and ``platform_kernel`` picks each branch's kernel
from the platform: Mosaic TPU on TPU, else the GPU-style kernel, as Pallas Triton or, on
Hopper (``gpu_kernels`` "auto" or "mosaic"), Mosaic GPU (interpreted on CPU). On Hopper, "auto"
runs each branch on what an H200 timed fastest (docs/nsa.md): Mosaic GPU for the selected and
compressed branches, cuDNN's sliding window for the window.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.nsa import compressed_gpu, select_gpu, window_gpu
from pallas_kernels.nsa.compressed_gpu import compressed_attention_gpu
from pallas_kernels.nsa.compressed_tpu import compressed_attention_tpu
from pallas_kernels.nsa.select_gpu import select_attention_gpu
from pallas_kernels.nsa.select_tpu import select_attention_tpu
from pallas_kernels.nsa.window_gpu import sliding_window_attention_gpu
from pallas_kernels.nsa.window_tpu import sliding_window_attention_tpu
from pallas_kernels.nsa.xla import NSAShape, nsa_forward, sliding_window_banded

# branch -> (TPU kernel, GPU-style kernel, that kernel's BlockSizes)
_KERNELS = {
    "select": (select_attention_tpu, select_attention_gpu, select_gpu.BlockSizes),
    "window": (sliding_window_attention_tpu, sliding_window_attention_gpu, window_gpu.BlockSizes),
    "compressed": (compressed_attention_tpu, compressed_attention_gpu, compressed_gpu.BlockSizes),
}


def is_hopper(device) -> bool:
    """NVIDIA compute capability 9.0 or later (wgmma and TMA, which Mosaic GPU's kernels need);
    ROCm devices report an arch name ("gfx942") instead."""
    try:
        return float(getattr(device, "compute_capability", "0")) >= 9.0
    except ValueError:
        return False


def _mosaic_gpu(gpu_kernels: str) -> bool:
    """Whether this platform runs the Mosaic GPU kernels: a Hopper GPU, `gpu_kernels` not
    "triton"."""
    if gpu_kernels not in ("auto", "triton", "mosaic"):
        raise ValueError(f"gpu_kernels={gpu_kernels!r} is not 'auto', 'triton' or 'mosaic'")
    return gpu_kernels != "triton" and jax.default_backend() == "gpu" and is_hopper(jax.devices()[0])


def platform_kernel(branch: str, *, interpret: bool, gpu_kernels: str = "auto"):
    """The kernel of `branch` ("select", "window", "compressed") for this platform: TPU runs the
    Mosaic TPU kernel, anything else the GPU-style one, on Mosaic GPU when the GPU is a Hopper
    and `gpu_kernels` is "auto" or "mosaic" (older GPUs and ROCm keep Triton)."""
    tpu, gpu, block_sizes = _KERNELS[branch]
    if jax.default_backend() == "tpu":
        return functools.partial(tpu, interpret=interpret)
    backend = "mosaic" if _mosaic_gpu(gpu_kernels) else "triton"
    return functools.partial(gpu, interpret=interpret, block_sizes=block_sizes(backend=backend))


def sliding_window_cudnn(q, k, v, *, window, scale, implementation="cudnn"):
    """The window branch on cuDNN's sliding-window attention (keys t - window < s <= t), the
    banded XLA form where cuDNN takes no such inputs (float32, head dims past 128). On an H200
    at 64k: 1.1 ms forward, 4.0 ms with the backward, against the Mosaic kernel's 2.7 and 8.1.
    (`implementation="xla"` runs the same call on any platform: how the CPU tests check it.)"""
    h = q.shape[-1]
    if q.dtype not in (jnp.bfloat16, jnp.float16) or h % 8 or h > 128 or v.shape[-1] != h:
        return sliding_window_banded(q, k, v, window=window, scale=scale)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, local_window_size=(window - 1, 0),
                                        implementation=implementation)


def branch_kernels(kernels: str = "auto", gpu_kernels: str = "auto"):
    """(select_fn, window_fn, compressed_fn) for ``nsa_forward``, per `model.nsa.kernels`; None
    is the branch's plain-XLA form. "auto": on a Hopper GPU (`gpu_kernels` not "triton") the
    fastest per branch, the selected and compressed kernels on Mosaic GPU and cuDNN's window;
    the selected branch alone on other GPUs and TPU; none on CPU. On CPU the kernels run
    interpreted. Decided at trace time, from the platform."""
    on_accelerator = jax.default_backend() in ("gpu", "tpu")
    options = dict(interpret=not on_accelerator, gpu_kernels=gpu_kernels)
    if kernels == "auto" and _mosaic_gpu(gpu_kernels):
        return (functools.partial(select_attention, **options), sliding_window_cudnn,
                functools.partial(compressed_attention, **options))
    if kernels == "auto":
        kernels = "select" if on_accelerator else "xla"
    if kernels == "xla":
        return None, None, None
    select = functools.partial(select_attention, **options)
    if kernels == "select":
        return select, None, None
    return (select, functools.partial(sliding_window_attention, **options),
            functools.partial(compressed_attention, **options))


def nsa_attention(q, k, v, params, shape: NSAShape, *, kernels: str = "auto", gpu_kernels: str = "auto"):
    """The NSA layer on a causal sequence, q[B,T,N,H], k[B,S,K,H], v[B,S,K,V] -> [B,T,N,V]: the
    branches `kernels` names ("auto", "xla", "select", "all") as Pallas kernels, the others in
    XLA (``xla.nsa_forward``). ``params``: {"compress_k", "compress_v", "gate"}. On a GPU the
    top-n takes rounds of argmax (``xla.top_n``: 4x faster than XLA's TopK kernel at 64k)."""
    select_fn, window_fn, compressed_fn = branch_kernels(kernels, gpu_kernels)
    return nsa_forward(q, k, v, params, shape, select_fn=select_fn, window_fn=window_fn,
                       compressed_fn=compressed_fn,
                       top_n_form="argmax" if jax.default_backend() == "gpu" else "top_k")


def select_attention(q, k, v, block_idx, *, block_size, causal=True, scale=None, interpret=False,
                     gpu_kernels="auto"):
    """q[B,T,Hq,D], k[B,S,Hkv,D], v[B,S,Hkv,Dv], block_idx[B,T,Hkv,n] int32 -> [B,T,Hq,Dv].

    Query t of head h attends to the keys of the blocks listed for its kv head h // (Hq/Hkv)
    (each listed block once), keys s <= t when causal; -1 marks an unused slot; scale defaults
    to 1/sqrt(D). The kernel is ``platform_kernel``'s. Differentiable in q, k, v.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or block_idx.ndim != 4:
        raise ValueError(
            f"select_attention: q, k, v, block_idx must be 4-D, got {q.shape}, {k.shape}, "
            f"{v.shape}, {block_idx.shape}"
        )
    b, t, hq, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[-1] != d:
        raise ValueError(f"select_attention: k {k.shape} and v {v.shape} do not match q {q.shape}")
    if hq % k.shape[2]:
        raise ValueError(f"select_attention: Hq={hq} is not a multiple of Hkv={k.shape[2]}")
    if block_idx.shape[:3] != (b, t, k.shape[2]):
        raise ValueError(f"select_attention: block_idx {block_idx.shape} must be [B,T,Hkv,n] = [{b},{t},{k.shape[2]},n]")
    if block_size < 1:
        raise ValueError(f"select_attention: block_size={block_size} must be positive")
    kernel = platform_kernel("select", interpret=interpret, gpu_kernels=gpu_kernels)
    return kernel(q, k, v, block_idx.astype("int32"), block_size=block_size, causal=causal, scale=scale)


def sliding_window_attention(q, k, v, *, window, scale=None, interpret=False, gpu_kernels="auto"):
    """q[B,T,Hq,D], k[B,S,Hkv,D], v[B,S,Hkv,Dv] -> [B,T,Hq,Dv].

    Query t of head h attends to the keys s of kv head h // (Hq/Hkv) with t - window < s <= t
    (a query past the last key, S < T, sees none and gets zeros); scale defaults to 1/sqrt(D).
    The kernel is ``platform_kernel``'s. Differentiable in q, k, v.
    """
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"sliding_window_attention: q, k, v must be 4-D, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"sliding_window_attention: k {k.shape} and v {v.shape} do not match q {q.shape}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"sliding_window_attention: Hq={q.shape[2]} is not a multiple of Hkv={k.shape[2]}")
    if int(window) != window or window < 1:
        raise ValueError(f"sliding_window_attention: window={window} must be a positive integer")
    kernel = platform_kernel("window", interpret=interpret, gpu_kernels=gpu_kernels)
    return kernel(q, k, v, window=int(window), scale=scale)


def compressed_attention(q, k_cmp, v_cmp, *, shape: NSAShape, num_select_blocks, scale=None, interpret=False,
                         gpu_kernels="auto"):
    """q[B,T,N,H], k_cmp[B,C,K,H], v_cmp[B,C,K,V] -> (o [B,T,N,V], importance [B,T,K,P]).

    Query t attends to the compressed blocks i with i*d + l - 1 <= t (eq. 7; none: zeros) and
    reports, per selection block j < P = num_select_blocks, its probabilities mapped by eq. 9
    and summed over its GQA group (eq. 10), the input of the top-n (``xla.top_blocks``).
    Differentiable in q, k_cmp, v_cmp through o; the importance takes no gradient. The kernel is
    ``platform_kernel``'s.
    """
    if q.ndim != 4 or k_cmp.ndim != 4 or v_cmp.ndim != 4:
        raise ValueError(f"compressed_attention: q, k_cmp, v_cmp must be 4-D, got {q.shape}, {k_cmp.shape}, {v_cmp.shape}")
    b, t, n, h = q.shape
    if k_cmp.shape[:3] != v_cmp.shape[:3] or k_cmp.shape[0] != b or k_cmp.shape[-1] != h:
        raise ValueError(f"compressed_attention: k_cmp {k_cmp.shape} and v_cmp {v_cmp.shape} do not match q {q.shape}")
    kh = k_cmp.shape[2]
    if n % kh:
        raise ValueError(f"compressed_attention: Hq={n} is not a multiple of Hkv={kh}")
    if num_select_blocks < 1:
        raise ValueError(f"compressed_attention: num_select_blocks={num_select_blocks} must be positive")
    if k_cmp.shape[1] == 0:  # shorter than one compression block: nothing to attend to
        return jnp.zeros((b, t, n, v_cmp.shape[-1]), q.dtype), jnp.zeros((b, t, kh, num_select_blocks), jnp.float32)
    kernel = platform_kernel("compressed", interpret=interpret, gpu_kernels=gpu_kernels)
    return kernel(q, k_cmp, v_cmp, shape=shape, num_select_blocks=num_select_blocks, scale=scale)
