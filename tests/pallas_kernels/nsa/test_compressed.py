"""Compressed-branch kernels (attention + block importance; GPU-style and TPU-style) against
the float64 reference.

Interpret mode on CPU is slow, so the default cases are short sequences with small tiles (many
compressed tiles per query tile, the eq. 9 spill across every tile edge); larger sweeps run
under ``-m slow`` and the compiled kernels under ``-m gpu``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.nsa import NSAShape, compressed_attention
from pallas_kernels.nsa import reference as R
from pallas_kernels.nsa import xla as X
from pallas_kernels.nsa.compressed_gpu import BlockSizes as GpuBlockSizes
from pallas_kernels.nsa.compressed_gpu import compressed_attention_gpu
from pallas_kernels.nsa.compressed_tpu import BlockSizes, compressed_attention_tpu
from pallas_kernels.nsa.select_gpu import select_attention_gpu
from pallas_kernels.nsa.select_tpu import select_attention_tpu
from pallas_kernels.nsa.window_gpu import BlockSizes as WindowGpuBlockSizes
from pallas_kernels.nsa.window_gpu import sliding_window_attention_gpu
from pallas_kernels.nsa.window_tpu import BlockSizes as WindowTpuBlockSizes
from pallas_kernels.nsa.window_tpu import sliding_window_attention_tpu

FWD_TOL, GRAD_TOL = 2e-3, 5e-3


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _shape(l, d, lp):
    return NSAShape(compress_block=l, compress_stride=d, select_block=lp, num_selected=3, num_local_blocks=1, window=8)


def _inputs(seed, b, t, n, kh, h, vd, shape):
    """q, compressed k and v of a length-t sequence (C = (t - l) // d + 1 blocks), dO."""
    rng = np.random.default_rng(seed)
    c = (t - shape.compress_block) // shape.compress_stride + 1
    shapes = [(b, t, n, h), (b, c, kh, h), (b, c, kh, vd), (b, t, n, vd)]
    return [jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes]


def _check(kernel, q, k, v, do, shape, scale=None, tol=(FWD_TOL, GRAD_TOL), score_tol=FWD_TOL):
    p = -(-q.shape[1] // shape.select_block)
    call = functools.partial(kernel, shape=shape, num_select_blocks=p, scale=scale)
    ref = functools.partial(R.compressed_attention_reference, shape=shape, num_select_blocks=p, scale=scale)

    def run(fn, q, k, v, do):
        (out, score), vjp = jax.vjp(lambda q, k, v: fn(q, k, v), q, k, v)
        return out, score, vjp((do, jnp.zeros_like(score)))

    out, score, grads = jax.jit(functools.partial(run, call))(q, k, v, do)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in (q, k, v, do)]
        want = [np.asarray(x) for x in jax.tree.leaves(jax.jit(functools.partial(run, ref))(*f64))]
    want_out, want_score, want_grads = want[0], want[1], want[2:]
    assert out.shape == want_out.shape and out.dtype == q.dtype
    assert score.shape == want_score.shape == (q.shape[0], q.shape[1], k.shape[2], p)
    assert _rel(out, want_out) < tol[0], ("forward", _rel(out, want_out))
    assert _rel(score, want_score) < score_tol, ("importance", _rel(score, want_score))
    for name, g, w in zip(("q", "k_cmp", "v_cmp"), grads, want_grads):
        assert g.shape == w.shape
        assert _rel(g, w) < tol[1], (f"d{name}", _rel(g, w))
    _same_selection(score, want_score, shape, tie=score_tol)


def _same_selection(score, want_score, shape, tie):
    """The selection the importance feeds is the reference's as a set of blocks (their order
    does not change the selected branch), except where the reference's own scores tie within
    `tie`: a block the kernel picked instead of one of the reference's must score, by the
    reference, no more than `tie` (relative to the row's largest) below the reference's last
    pick. On an H200 the bf16 Mosaic kernel swapped near-tied blocks in 1% of the rows."""
    got = np.sort(np.asarray(X.top_blocks(score, shape)), axis=-1)
    want = np.sort(np.asarray(X.top_blocks(jnp.asarray(want_score), shape)), axis=-1)
    for row in zip(*np.nonzero((got != want).any(-1))):
        ref = np.asarray(want_score[row], np.float64)
        extra = np.setdiff1d(got[row], want[row])
        missing = np.setdiff1d(want[row], got[row])
        assert -1 not in extra and -1 not in missing, (row, got[row], want[row])
        gap = ref[missing].max() - ref[extra].min()  # the worst swap
        assert gap <= tie * np.abs(ref).max(), (row, got[row], want[row], gap)


def _gpu_style(tq, bk, g):
    """GPU-style kernels in interpret mode, query tiles of tq positions (rows = tq * Gp)."""
    gp = 1 << (g - 1).bit_length()
    return functools.partial(
        compressed_attention_gpu, interpret=True, block_sizes=GpuBlockSizes(block_q=tq * gp, block_k=bk)
    )


def _tpu_style(tq, bk, g):
    del g  # TPU tiles count positions already
    return functools.partial(compressed_attention_tpu, interpret=True, block_sizes=BlockSizes(block_q=tq, block_k=bk))


KERNELS = pytest.mark.parametrize("make", [_gpu_style, _tpu_style], ids=["gpu_style", "tpu_style"])

# (B, T, N, K, H, V, (l, d, l'), tiles (tq, bk), scale)
SMALL = [
    (2, 150, 4, 2, 24, 20, (32, 16, 64), (16, 8), None),  # the paper's ratios l = 2d, l' = 4d
    (1, 45, 6, 2, 16, 12, (8, 4, 16), (16, 4), 0.3),  # G=3 (padded to 4 on GPU), T not a tile multiple
    (1, 37, 3, 3, 8, 8, (4, 4, 4), (16, 4), None),  # l = d = l': eq. 9 is the identity
    (1, 61, 8, 1, 20, 16, (16, 4, 8), (16, 4), None),  # G=8, l = 4d spills 3 blocks over tile edges
]


@KERNELS
@pytest.mark.parametrize(("b", "t", "n", "kh", "h", "vd", "lds", "tiles", "scale"), SMALL)
def test_small(make, b, t, n, kh, h, vd, lds, tiles, scale):
    shape = _shape(*lds)
    q, k, v, do = _inputs(t, b, t, n, kh, h, vd, shape)
    _check(make(*tiles, n // kh), q, k, v, do, shape, scale)


def test_entry_point_errors_and_short_sequences():
    shape = _shape(8, 4, 16)
    q, k, v, _ = _inputs(3, 1, 27, 4, 2, 16, 8, shape)
    call = functools.partial(compressed_attention, shape=shape, num_select_blocks=2, interpret=True)
    got = jax.jit(call)(q, k, v)
    want = jax.jit(functools.partial(R.compressed_attention_reference, shape=shape, num_select_blocks=2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
    # shorter than one compression block: no compressed key at all
    out, score = call(q[:, :5], k[:, :0], v[:, :0])
    assert out.shape == (1, 5, 4, 8) and score.shape == (1, 5, 2, 2)
    assert not np.any(np.asarray(out)) and not np.any(np.asarray(score))
    with pytest.raises(ValueError, match="Hkv"):
        call(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="do not match"):
        call(q, k[..., :4], v)
    with pytest.raises(ValueError, match="4-D"):
        call(q[0], k, v)
    with pytest.raises(ValueError, match="block_k"):
        compressed_attention_gpu(q, k, v, shape=shape, num_select_blocks=2, interpret=True,
                                 block_sizes=GpuBlockSizes(block_k=6))


@pytest.mark.parametrize("style", ["gpu_style", pytest.param("tpu_style", marks=pytest.mark.slow)])  # TPU interpret: 25 s
def test_nsa_layer_with_all_three_kernels_equals_the_reference_layer(style):
    """nsa_forward with the compressed, selected and window kernels (what an accelerator runs)
    against nsa_reference in float64, values and gradients (q, k, v and the NSA parameters):
    the kernel's importance drives the selection of the whole layer."""
    shape = NSAShape(compress_block=8, compress_stride=4, select_block=16, num_selected=3, num_local_blocks=1, window=12)
    rng = np.random.default_rng(11)
    b, t, n, kh, h = 1, 83, 4, 2, 16
    q, k, v, do = (jnp.asarray(rng.standard_normal((b, t, m, h), np.float32)) for m in (n, kh, kh, n))
    params = R.init_nsa_params(jax.random.key(2), shape, n, h)
    if style == "gpu_style":
        kernels = dict(
            compressed_fn=_gpu_style(16, 8, n // kh),
            select_fn=functools.partial(select_attention_gpu, interpret=True),
            window_fn=functools.partial(sliding_window_attention_gpu, interpret=True,
                                        block_sizes=WindowGpuBlockSizes(block_q=16, block_k=16)),
        )
    else:
        kernels = dict(
            compressed_fn=_tpu_style(8, 8, n // kh),
            select_fn=functools.partial(select_attention_tpu, interpret=True),
            window_fn=functools.partial(sliding_window_attention_tpu, interpret=True,
                                        block_sizes=WindowTpuBlockSizes(block_q=8, block_k=8)),
        )

    def run(layer, q, k, v, params, do):
        out, vjp = jax.vjp(lambda *a: layer(*a), q, k, v, params)
        return out, vjp(do)

    got, got_grads = jax.jit(functools.partial(run, lambda *a: X.nsa_forward(*a, shape, **kernels)))(q, k, v, params, do)
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x), jnp.float64)
        want, want_grads = jax.jit(functools.partial(run, lambda *a: R.nsa_reference(*a, shape)))(
            *jax.tree.map(f64, (q, k, v, params, do)))
    assert _rel(got, want) < FWD_TOL
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads)):
        assert _rel(g, w) < GRAD_TOL, (jax.tree_util.keystr(path), _rel(g, w))


SWEEP = [
    # (G, H, V, (l, d, l'), tq, bk, T)
    (1, 64, 64, (32, 16, 64), 16, 16, 300),
    (2, 128, 96, (32, 16, 64), 32, 8, 257),
    (4, 64, 48, (32, 16, 32), 16, 4, 333),
    (8, 128, 128, (32, 16, 64), 16, 16, 410),
    (5, 32, 40, (16, 8, 64), 16, 16, 199),
]


@pytest.mark.slow
@KERNELS
@pytest.mark.parametrize(("g", "h", "vd", "lds", "tq", "bk", "t"), SWEEP)
def test_sweep(make, g, h, vd, lds, tq, bk, t):
    shape = _shape(*lds)
    q, k, v, do = _inputs(g * 7 + t, 1, t, 2 * g, 2, h, vd, shape)
    _check(make(tq, bk, g), q, k, v, do, shape)


# The Hopper kernels (compressed_mgpu) in GPU interpret mode, bf16 (wgmma's input): the values
# and gradients to bf16's tolerance; the importance (bf16 hi + lo pairs through the tensor core)
# to float32's, where the scale is a power of two (H = 64: q * scale is exact in bf16).
BF16_TOL = (1e-2, 1.5e-2)
MOSAIC = functools.partial(compressed_attention_gpu, interpret=True, block_sizes=GpuBlockSizes(backend="mosaic"))


def _bf16(xs):
    return [x.astype(jnp.bfloat16) for x in xs]


def test_mosaic_bf16_spill_across_blocks():
    # C = 69 compressed keys: two blocks of 64, and eq. 9's spill (l/d = 2, l'/d = 4 as in the
    # paper) crosses into the second; P = 18 selection blocks are W = 16 per block, so the
    # second block's are partial. Two kv heads.
    shape = _shape(2, 1, 4)
    q, k, v, do = _bf16(_inputs(21, 1, 70, 4, 2, 64, 64, shape))
    _check(MOSAIC, q, k, v, do, shape, tol=BF16_TOL, score_tol=1e-4)


@pytest.mark.slow
def test_mosaic_bf16_g16():
    # G = 16 (R = 4 positions a tile), H = 128, a scale that rounds q in bf16; l/d and l'/d are
    # the paper's (2 and 4), so eq. 9 has its geometry at 1/8 of the length
    shape = _shape(4, 2, 8)
    q, k, v, do = _bf16(_inputs(22, 1, 200, 16, 1, 128, 128, shape))
    _check(MOSAIC, q, k, v, do, shape, scale=0.1, tol=BF16_TOL, score_tol=1e-2)


def test_mosaic_declines_what_it_cannot_take():
    """Shapes compressed_mgpu cannot take fall back to the Triton kernels."""
    from pallas_kernels.nsa.compressed_mgpu import compressed_supports

    q, k, v, _ = _bf16(_inputs(23, 1, 140, 4, 2, 64, 64, _shape(4, 2, 8)))
    assert compressed_supports(q, k, v, _shape(4, 2, 8)) is None
    assert "16 or more" in compressed_supports(q, k, v, _shape(4, 2, 32))  # W = 4 selection blocks a tile
    assert "dtype" in compressed_supports(q.astype(jnp.float32), k, v, _shape(4, 2, 8))


needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("g", "h", "vd", "t"), [(1, 64, 64, 300), (2, 128, 96, 257), (4, 128, 128, 4100), (16, 128, 128, 2050)])
def test_compiled_gpu(g, h, vd, t):
    shape = NSAShape()
    q, k, v, do = _inputs(g + t, 2, t, 2 * g, 2, h, vd, shape)
    _check(compressed_attention_gpu, q, k, v, do, shape)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("g", "h", "t"), [(1, 64, 300), (4, 128, 4100), (16, 128, 2050)])
def test_compiled_mosaic(g, h, t):
    shape = NSAShape()
    q, k, v, do = _bf16(_inputs(g + t, 2, t, 2 * g, 2, h, h, shape))
    kernel = functools.partial(compressed_attention_gpu, block_sizes=GpuBlockSizes(backend="mosaic"))
    _check(kernel, q, k, v, do, shape, tol=BF16_TOL, score_tol=1e-2)
