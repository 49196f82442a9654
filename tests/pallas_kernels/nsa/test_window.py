"""Sliding-window attention kernels (GPU-style and TPU-style) against the float64 reference.

Interpret mode on CPU is slow, so the default cases are short sequences with small tiles (many
tiles per band, band edges in every tile); larger sweeps run under ``-m slow`` and the compiled
kernels under ``-m gpu``.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.nsa import sliding_window_attention
from pallas_kernels.nsa.reference import sliding_window_reference
from pallas_kernels.nsa._band import Band
from pallas_kernels.nsa.window_gpu import sliding_window_attention_gpu
from pallas_kernels.nsa.window_gpu import BlockSizes as GpuBlockSizes
from pallas_kernels.nsa.window_tpu import BlockSizes, sliding_window_attention_tpu

FWD_TOL, GRAD_TOL = 2e-3, 5e-3
BF16_TOL = (1e-2, 1.5e-2)  # measured 2.8e-3 / 3.4e-3: bf16 rounding of p and the output


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _inputs(seed, b, t, n, kh, h, vd, s=None):
    """q, k, v, dO from numpy's generator: no XLA compile per shape, unlike jax.random eagerly."""
    rng = np.random.default_rng(seed)
    s = s or t
    shapes = [(b, t, n, h), (b, s, kh, h), (b, s, kh, vd), (b, t, n, vd)]
    return [jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in shapes]


def _check(kernel, q, k, v, do, window, scale=None, tol=(FWD_TOL, GRAD_TOL)):
    @jax.jit
    def run(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, window=window, scale=scale), q, k, v)
        return out, vjp(do)

    @jax.jit
    def reference(q, k, v, do):
        want, vjp = jax.vjp(lambda q, k, v: sliding_window_reference(q, k, v, window=window, scale=scale), q, k, v)
        return want, vjp(do)

    out, grads = run(q, k, v)
    with jax.enable_x64(True):
        want, want_grads = reference(*[jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, do)])
        want, want_grads = np.asarray(want), [np.asarray(g) for g in want_grads]
    assert out.shape == want.shape and out.dtype == q.dtype
    assert _rel(out, want) < tol[0], ("forward", _rel(out, want))
    for name, g, w in zip("qkv", grads, want_grads):
        assert g.shape == w.shape
        assert _rel(g, w) < tol[1], (f"d{name}", _rel(g, w))


def _gpu_style(tq, bk, g):
    """GPU-style kernel in interpret mode with query tiles of tq positions (rows = tq * Gp)."""
    gp = 1 << (g - 1).bit_length()
    return functools.partial(
        sliding_window_attention_gpu, interpret=True, block_sizes=GpuBlockSizes(block_q=tq * gp, block_k=bk)
    )


def _tpu_style(tq, bk, g):
    del g  # TPU tiles count positions already
    return functools.partial(sliding_window_attention_tpu, interpret=True, block_sizes=BlockSizes(block_q=tq, block_k=bk))


KERNELS = pytest.mark.parametrize("make", [_gpu_style, _tpu_style], ids=["gpu_style", "tpu_style"])

# (B, T, N, K, H, V, window, scale); tiles of 8 query positions and 8 keys
SMALL = [
    (2, 37, 4, 2, 48, 40, 5, None),  # G=2, window < tile, T not a tile multiple, H, V not 2^k
    (1, 29, 3, 3, 64, 24, 13, 0.37),  # G=1, window not a tile multiple
    (1, 19, 8, 2, 20, 12, 25, None),  # G=4, window >= T
]


@KERNELS
@pytest.mark.parametrize(("b", "t", "n", "kh", "h", "vd", "w", "scale"), SMALL)
def test_small(make, b, t, n, kh, h, vd, w, scale):
    q, k, v, do = _inputs(t, b, t, n, kh, h, vd)
    _check(make(8, 8, n // kh), q, k, v, do, w, scale)


def test_gpu_style_fewer_keys_than_queries_gqa3():
    # S < T, window 6: queries 22.. see no key (zero rows, no gradient through them)
    q, k, v, do = _inputs(5, 1, 26, 6, 2, 24, 16, s=17)
    _check(_gpu_style(8, 8, 3), q, k, v, do, 6)


@pytest.mark.parametrize(("stride", "first"), [(1, 0), (2, 3), (4, 7)])  # the window; compressed blocks
def test_band_tiles_cover_the_visible_pairs(stride, first):
    """The loops and the TPU grid visit key tiles [lo, hi) per query tile and query tiles [lo, hi)
    per key tile: brute force says they cover every visible pair (key i at position
    stride * i + first), stay within the static band lengths, and (key tiles, keys up to the
    last query, no window falling between strided keys) are exactly the tiles with a visible pair."""
    for t, s, w, tq, bk in itertools.product((1, 9, 24), (7, 24, 30), (1, 3, 8, 40, None), (1, 4, 8), (2, 8)):
        band = Band(t, s, w, 1.0, 1, tq, bk, None, stride, first)
        see = np.zeros((band.num_q_tiles, band.num_k_tiles), bool)
        for qt, kt in np.ndindex(*see.shape):
            qs = np.arange(qt * tq, min(t, (qt + 1) * tq))[:, None]
            ks = stride * np.arange(kt * bk, min(s, (kt + 1) * bk))[None, :] + first
            see[qt, kt] = ((ks <= qs) & (w is None or ks > qs - w)).any()
        case = (t, s, w, tq, bk)
        for qt, row in enumerate(see):
            lo, hi = (int(x) for x in band.key_tiles(jnp.int32(qt * tq)))
            need = set(np.flatnonzero(row))
            assert need <= set(range(lo, hi)) and hi - lo <= band.band_k_tiles, (case, qt)
            loose = stride * (s - 1) + first < t - 1 or (stride > 1 and w is not None)
            assert loose or need == set(range(lo, hi)), (case, qt)
        for kt, col in enumerate(see.T):
            lo, hi = (int(x) for x in band.query_tiles(jnp.int32(kt * bk)))
            assert set(np.flatnonzero(col)) <= set(range(lo, hi)) and hi - lo <= band.band_q_tiles, (case, kt)


def test_sliding_window_attention_entry_point_and_errors():
    q, k, v, _ = _inputs(4, 1, 11, 4, 2, 8, 12)
    got = jax.jit(functools.partial(sliding_window_attention, window=3, interpret=True))(q, k, v)
    want = jax.jit(functools.partial(sliding_window_reference, window=3))(q, k, v)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="window"):
        sliding_window_attention(q, k, v, window=0, interpret=True)
    with pytest.raises(ValueError, match="Hkv"):
        sliding_window_attention(q[:, :, :3], k, v, window=3, interpret=True)
    with pytest.raises(ValueError, match="do not match"):
        sliding_window_attention(q, k[..., :4], v, window=3, interpret=True)
    with pytest.raises(ValueError, match="4-D"):
        sliding_window_attention(q[0], k, v, window=3, interpret=True)


SWEEP = [
    # (G, H, V, tq, bk, window, T, S)
    (1, 64, 64, 32, 32, 100, 300, 300),
    (2, 128, 96, 16, 32, 64, 200, 200),
    (4, 48, 80, 16, 16, 33, 257, 257),
    (8, 128, 128, 8, 64, 512, 333, 333),
    (8, 64, 48, 4, 16, 7, 150, 150),
    (3, 32, 16, 8, 16, 20, 90, 61),  # S < T
    (2, 16, 40, 8, 8, 9, 45, 70),  # S > T
]


@pytest.mark.slow
@KERNELS
@pytest.mark.parametrize(("g", "h", "vd", "tq", "bk", "w", "t", "s"), SWEEP)
def test_sweep(make, g, h, vd, tq, bk, w, t, s):
    q, k, v, do = _inputs(g * 7 + w, 1, t, 2 * g, 2, h, vd, s=s)
    _check(make(tq, bk, g), q, k, v, do, w)


def _bf16(xs):
    return [x.astype(jnp.bfloat16) for x in xs]


# the Hopper kernels (select_mgpu: each tile's band as its block selection) in GPU interpret mode
MOSAIC = functools.partial(sliding_window_attention_gpu, interpret=True, block_sizes=GpuBlockSizes(backend="mosaic"))


@pytest.mark.slow  # 40-50 s; the select_mgpu kernels it runs on are select's default Mosaic test
def test_mosaic_bf16_window_across_blocks():
    # G=1 pads to Gp=2 -> 32 positions a tile; w=40 spans two 64-key blocks for most tiles;
    # T=100 leaves a partial tile, S=90 a partial block and a tile that starts past the keys.
    q, k, v, do = _bf16(_inputs(11, 1, 100, 2, 2, 64, 64, s=90))
    _check(MOSAIC, q, k, v, do, 40, tol=BF16_TOL)


@pytest.mark.slow
def test_mosaic_bf16_gqa4_long_window_fewer_keys():
    q, k, v, do = _bf16(_inputs(12, 1, 150, 8, 2, 128, 128, s=130))
    _check(MOSAIC, q, k, v, do, 100, scale=0.3, tol=BF16_TOL)


needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(
    ("g", "h", "vd", "w", "t"),
    [(1, 64, 64, 100, 300), (2, 128, 96, 64, 200), (4, 48, 80, 33, 257), (8, 128, 128, 512, 333), (4, 128, 128, 512, 4100)],
)
def test_compiled_gpu(g, h, vd, w, t):
    q, k, v, do = _inputs(g * 7 + w, 2, t, 2 * g, 2, h, vd)
    _check(sliding_window_attention_gpu, q, k, v, do, w)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("g", "h", "w", "t"), [(1, 64, 100, 300), (4, 128, 512, 4100), (16, 128, 512, 2000)])
def test_compiled_mosaic(g, h, w, t):
    q, k, v, do = _bf16(_inputs(g * 7 + w, 2, t, 2 * g, 2, h, h))
    kernel = functools.partial(sliding_window_attention_gpu, block_sizes=GpuBlockSizes(backend="mosaic"))
    _check(kernel, q, k, v, do, w, tol=BF16_TOL)
