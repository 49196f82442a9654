"""Selected-block attention kernels (GPU-style and TPU-style) against the float64 reference.

Interpret mode on CPU is slow, so the default cases are short sequences; the issue's sweep
runs under ``-m slow`` and the compiled kernels under ``-m gpu``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.nsa import NSAShape, select_attention, select_attention_reference
from pallas_kernels.nsa import reference as R
from pallas_kernels.nsa.select_gpu import BlockSizes as GpuBlockSizes
from pallas_kernels.nsa.select_gpu import select_attention_gpu
from pallas_kernels.nsa.select_tpu import BlockSizes, select_attention_tpu

FWD_TOL, GRAD_TOL = 2e-3, 5e-3


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _inputs(seed, b, t, n, kh, h, vd, s=None):
    ks = jax.random.split(jax.random.key(seed), 4)
    s = s or t
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32)
    k = jax.random.normal(ks[1], (b, s, kh, h), jnp.float32)
    v = jax.random.normal(ks[2], (b, s, kh, vd), jnp.float32)
    do = jax.random.normal(ks[3], (b, t, n, vd), jnp.float32)
    return q, k, v, do


def _check(kernel, q, k, v, do, idx, block_size, causal=True, scale=None):
    @jax.jit
    def run(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, idx, block_size=block_size, causal=causal, scale=scale), q, k, v)
        return out, vjp(do)

    out, grads = run(q, k, v)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, do)]
        want, vjp = jax.vjp(
            lambda q, k, v: select_attention_reference(q, k, v, idx, block_size=block_size, causal=causal, scale=scale),
            *f64[:3],
        )
        want_grads = vjp(f64[3])
        want, want_grads = np.asarray(want), [np.asarray(g) for g in want_grads]
    assert out.shape == want.shape and out.dtype == q.dtype
    assert _rel(out, want) < FWD_TOL, ("forward", _rel(out, want))
    for name, g, w in zip("qkv", grads, want_grads):
        assert g.shape == w.shape
        assert _rel(g, w) < GRAD_TOL, (f"d{name}", _rel(g, w))


# dK/dV lists of more than 5 queries are split, so the segment sums are exercised
GPU_STYLE = functools.partial(select_attention_gpu, interpret=True, block_sizes=GpuBlockSizes(dkdv_queries=5))
TPU_STYLE = functools.partial(select_attention_tpu, interpret=True, block_sizes=BlockSizes(max_scalar_prefetch=40))


@pytest.mark.parametrize("kernel", [GPU_STYLE, TPU_STYLE], ids=["gpu_style", "tpu_style"])
def test_random_blocks_padding_repeats_gqa3(kernel):
    # T=21 is not a multiple of the block size; slots hold -1, repeats and future blocks.
    q, k, v, do = _inputs(0, 2, 21, 6, 2, 16, 12)
    idx = jax.random.randint(jax.random.key(9), (2, 21, 2, 3), -1, 4)
    _check(kernel, q, k, v, do, idx, block_size=8)


@pytest.mark.slow
def test_gpu_style_shorter_than_one_block_non_causal_scale():
    q, k, v, do = _inputs(1, 1, 5, 4, 4, 8, 16, s=7)
    idx = jnp.zeros((1, 5, 4, 2), jnp.int32).at[..., 1].set(-1)
    _check(GPU_STYLE, q, k, v, do, idx, block_size=16, causal=False, scale=0.37)


@pytest.mark.slow
def test_gpu_style_nsa_selection_with_ties_all_queries_share_blocks():
    """Block lists from the reference selector on a constant query: every compressed score ties,
    so all queries pick the same lowest blocks (many queries per key block in dK/dV)."""
    shape = NSAShape(compress_block=8, compress_stride=4, select_block=8, num_selected=3)
    q, k, v, do = _inputs(2, 1, 30, 8, 1, 8, 8)
    k_cmp = R.compress_blocks(k, R.init_compress_params(jax.random.key(3), shape, 8), shape)
    idx = R.nsa_block_idx(jnp.ones_like(q), k_cmp, shape, 30, 0.35)
    assert int(jnp.sum(idx[0, :, 0] == 1)) > 10  # block 1 wins its ties for every late query
    _check(GPU_STYLE, q, k, v, do, idx, block_size=8)


def test_select_attention_entry_point_and_errors():
    q, k, v, _ = _inputs(4, 1, 9, 2, 1, 8, 8)
    idx = jnp.array(np.tile([[0, -1]], (9, 1))[None, :, None, :], jnp.int32)
    got = select_attention(q, k, v, idx, block_size=4, interpret=True)
    np.testing.assert_allclose(got, select_attention_reference(q, k, v, idx, block_size=4), rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="block_idx"):
        select_attention(q, k, v, idx[:, :5], block_size=4, interpret=True)
    with pytest.raises(ValueError, match="Hkv"):
        select_attention(q[:, :, :1].repeat(3, 2), k.repeat(2, 2), v.repeat(2, 2), idx, block_size=4, interpret=True)


SWEEP = [
    # (G, H, block_size, n, T)
    (1, 64, 32, 1, 45),
    (2, 128, 64, 4, 200),
    (4, 64, 128, 2, 300),
    (8, 128, 32, 16, 333),
    (8, 64, 64, 16, 50),
]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", [GPU_STYLE, TPU_STYLE], ids=["gpu_style", "tpu_style"])
@pytest.mark.parametrize(("g", "h", "bs", "n", "t"), SWEEP)
def test_sweep(kernel, g, h, bs, n, t):
    q, k, v, do = _inputs(g * 7 + n, 1, t, 2 * g, 2, h, h)
    idx = jax.random.randint(jax.random.key(t), (1, t, 2, n), -1, -(-t // bs))
    _check(kernel, q, k, v, do, idx, block_size=bs)


needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("g", "h", "bs", "n", "t"), [*SWEEP, (4, 128, 64, 16, 4100)])
def test_compiled_gpu(g, h, bs, n, t):
    q, k, v, do = _inputs(g * 7 + n, 2, t, 2 * g, 2, h, h)
    idx = jax.random.randint(jax.random.key(t), (2, t, 2, n), -1, -(-t // bs))
    _check(select_attention_gpu, q, k, v, do, idx, block_size=bs)
