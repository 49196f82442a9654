"""The NSA kernels lower for the hardware they target, checked on a CPU host.

The `lower` fixture (conftest) exports for "cuda" or "tpu", no accelerator needed: it catches a
primitive without a lowering rule, a tile that is not a power of two (Triton) or an index map
Mosaic cannot take, at the production block sizes and a shape that is not a tile multiple.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.nsa import NSAShape
from pallas_kernels.nsa.compressed_gpu import BlockSizes as CompressedBlockSizes
from pallas_kernels.nsa.compressed_gpu import compressed_attention_gpu
from pallas_kernels.nsa.compressed_tpu import compressed_attention_tpu
from pallas_kernels.nsa.select_gpu import BlockSizes, select_attention_gpu
from pallas_kernels.nsa.select_tpu import select_attention_tpu
from pallas_kernels.nsa.window_gpu import BlockSizes as WindowBlockSizes
from pallas_kernels.nsa.window_gpu import sliding_window_attention_gpu
from pallas_kernels.nsa.window_tpu import sliding_window_attention_tpu

SHAPE = NSAShape()  # the paper's l=32, d=16, l'=64, n=16, w=512
B, T = 1, 1000
TARGET = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _select(kernel):
    def attend(q, k, v):
        idx = jnp.zeros((*q.shape[:2], k.shape[2], SHAPE.num_selected), jnp.int32)
        return kernel(q, k, v, idx, block_size=SHAPE.select_block)

    return attend


def _window(kernel):
    return lambda q, k, v: kernel(q, k, v, window=SHAPE.window)


def _compressed(kernel):
    return lambda q, k, v: kernel(q, k, v, shape=SHAPE, num_select_blocks=-(-T // SHAPE.select_block))


CASES = {  # name: (platform, kernel, keys: the sequence's or its compressed blocks)
    "select_gpu": ("cuda", _select(select_attention_gpu), T),
    "select_tpu": ("tpu", _select(select_attention_tpu), T),
    # the Hopper kernels (Mosaic GPU) where the dtype allows, else the Triton ones
    "select_mosaic_gpu": ("cuda", _select(functools.partial(select_attention_gpu, block_sizes=BlockSizes(backend="mosaic"))), T),
    "window_gpu": ("cuda", _window(sliding_window_attention_gpu), T),
    "window_tpu": ("tpu", _window(sliding_window_attention_tpu), T),
    "window_mosaic_gpu": ("cuda", _window(functools.partial(sliding_window_attention_gpu, block_sizes=WindowBlockSizes(backend="mosaic"))), T),
    "compressed_gpu": ("cuda", _compressed(compressed_attention_gpu), (T - 32) // 16 + 1),
    "compressed_tpu": ("tpu", _compressed(compressed_attention_tpu), (T - 32) // 16 + 1),
    "compressed_mosaic_gpu": (
        "cuda", _compressed(functools.partial(compressed_attention_gpu, block_sizes=CompressedBlockSizes(backend="mosaic"))),
        (T - 32) // 16 + 1,
    ),
}


@pytest.mark.parametrize(("g", "kh", "h", "dtype"), [(4, 2, 128, jnp.bfloat16), (1, 3, 64, jnp.float32), (16, 1, 128, jnp.bfloat16)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_backward_lower(name, g, kh, h, dtype, lower):
    platform, attend, s_len = CASES[name]

    def fwd_bwd(q, k, v):  # the gradients, and the compressed branch's block importance
        outs, back = jax.vjp(lambda q, k, v: jax.tree.leaves(attend(q, k, v)), q, k, v)
        return back([outs[0].astype(q.dtype), *map(jnp.zeros_like, outs[1:])]), outs[1:]

    args = [jax.ShapeDtypeStruct(s, dtype) for s in ((B, T, g * kh, h), (B, s_len, kh, h), (B, s_len, kh, h))]
    module = lower(fwd_bwd, args, platform)
    if "mosaic" in name and dtype == jnp.bfloat16:  # forward, dQ, dK/dV, their segment sum (and scoring)
        assert module.count("mosaic_gpu") >= 4 + name.startswith("compressed") and TARGET[platform] not in module, name
    else:  # the forward, and the backward kernels (dQ, dK/dV); the compressed branch also scores
        assert module.count(TARGET[platform]) >= 3, name
