"""The attention seam (`pallas_kernels.attention`): what each backend option resolves to, and
the library kernels for causal rows (`pallas_kernels.causal_attention`) against the XLA
backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import dense_attention, resolve_backend
from pallas_kernels.causal_attention import cudnn_attention, splash_attention
from pallas_kernels.doc_attention.xla import xla_attention

needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")


def _inputs(seed, b, t, n, kv_heads, h, dtype=jnp.float32):
    """q [B, T, N, H], k and v [B, K, T, H] and an output cotangent, random."""
    rng = np.random.default_rng(seed)
    shapes = [(b, t, n, h), (b, kv_heads, t, h), (b, kv_heads, t, h), (b, t, n, h)]
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes)


def _causal_rows(lengths, t):
    """Segment ids [B, T] of right-padded rows: 1 on each row's first `length` slots."""
    return jnp.asarray(np.arange(t)[None, :] < np.asarray(lengths)[:, None], jnp.int32)


def _xla(q, k, v, seg):
    slots = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), seg.shape)
    return xla_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_slots=slots,
                         kv_slots=slots)


def _value_and_grads(attend, q, k, v, do):
    """One compiled program (op-by-op dispatch of the backward is slower than compiling it)."""

    @jax.jit
    def run(q, k, v, do):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(do))

    return run(q, k, v, do)


def _assert_same(attend, q, k, v, do, seg, tol):
    """`attend`'s output and gradients against the XLA backend's in float32."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want = _value_and_grads(lambda *a: _xla(*a, seg), *f32)
    got = _value_and_grads(attend, q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=tol, rtol=tol, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Which backend runs.


@pytest.mark.parametrize(("platform", "kind", "rows", "dtype", "want"), [
    ("gpu", "dense", "causal", "bfloat16", "cudnn"),
    ("gpu", "dense", "causal", "float32", "pallas"),  # cuDNN's flash attention is 16-bit only
    ("gpu", "dense", "segments", "bfloat16", "pallas"),
    # cached calls (prefill and decode steps) on the doc and decode kernels on a GPU
    ("gpu", "dense", "cached", "bfloat16", "pallas"),
    ("gpu", "dense", "cached", "float32", "pallas"),
    ("tpu", "dense", "cached", "bfloat16", "xla"),
    ("cpu", "dense", "cached", "float32", "xla"),
    ("gpu", "doc", "causal", "bfloat16", "pallas"),
    ("tpu", "dense", "causal", "bfloat16", "splash"),
    ("tpu", "dense", "segments", "bfloat16", "xla"),
    ("tpu", "doc", "segments", "bfloat16", "xla"),
    ("cpu", "dense", "causal", "float32", "xla"),
    ("cpu", "dense", "segments", "float32", "xla"),
    ("cpu", "doc", "segments", "float32", "pallas"),
])
def test_auto_picks_per_platform_and_rows(platform, kind, rows, dtype, want):
    assert resolve_backend(kind, "auto", rows=rows, platform=platform, dtype=dtype,
                           devices=1) == want


def test_splash_runs_on_one_tpu_chip_only():
    """jax cannot partition a Mosaic kernel over a mesh: auto falls back to XLA there, and an
    explicit splash says why."""
    resolve = lambda backend, devices: resolve_backend(  # noqa: E731
        "dense", backend, rows="causal", platform="tpu", devices=devices)
    assert resolve("auto", 1) == resolve("splash", 1) == "splash"
    assert resolve("auto", 4) == "xla"
    with pytest.raises(ValueError, match="splash is a Mosaic kernel.*mesh of 4 devices"):
        resolve("splash", 4)
    assert resolve_backend("dense", "splash", rows="cached", platform="tpu", devices=4) == "xla"


def test_explicit_backend_runs_where_it_can_or_says_why():
    resolve = lambda backend, rows="causal", platform="gpu", dtype="bfloat16": resolve_backend(  # noqa: E731
        "dense", backend, rows=rows, platform=platform, dtype=dtype)
    assert [resolve(b) for b in ("xla", "pallas", "cudnn")] == ["xla", "pallas", "cudnn"]
    assert resolve("splash", platform="tpu") == resolve("splash", platform="cpu") == "splash"
    # The training-pass kernels leave the sampler's cached calls to auto.
    assert resolve("cudnn", rows="cached") == "pallas"
    assert resolve("splash", rows="cached", platform="tpu") == "xla"
    with pytest.raises(ValueError, match="cudnn runs on gpu, not cpu"):
        resolve("cudnn", platform="cpu")
    with pytest.raises(ValueError, match="splash runs on tpu or cpu, not gpu"):
        resolve("splash")
    with pytest.raises(ValueError, match="cudnn needs model.dtype bfloat16.*not float32"):
        resolve("cudnn", dtype="float32")
    with pytest.raises(ValueError, match="cudnn runs causal rows only.*train.share_prompt"):
        resolve("cudnn", rows="segments")
    with pytest.raises(ValueError, match="unknown backend 'doc'; known: auto, xla, pallas, cudnn, splash"):
        resolve("doc")


# ---------------------------------------------------------------------------------------------
# cuDNN: the call's causal flag and lengths, checked on jax's XLA path (any platform), and
# the cuDNN kernel itself on a GPU.


def test_cudnn_call_masks_as_the_xla_backend():
    """Rows of distinct lengths (one full, one empty) through the very call the cudnn backend
    makes, on jax's XLA implementation: same outputs and gradients as our XLA backend."""
    b, t, n, kv_heads, h = 4, 37, 15, 5, 11
    q, k, v, do = _inputs(0, b, t, n, kv_heads, h)
    seg = _causal_rows([37, 23, 0, 9], t)
    attend = lambda q, k, v: cudnn_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg,  # noqa: E731
                                             implementation="xla")
    _assert_same(attend, q, k, v, do, seg, tol=2e-5)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize(("b", "t", "n", "kv_heads", "h"), [(3, 1000, 14, 2, 64), (2, 4099, 12, 4, 128)])
def test_cudnn_matches_xla_on_gpu(b, t, n, kv_heads, h):
    q, k, v, do = _inputs(t, b, t, n, kv_heads, h, jnp.bfloat16)
    seg = _causal_rows(np.linspace(t, t // 3, b).astype(int), t)
    attend = lambda q, k, v: dense_attention(  # noqa: E731
        q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_slots=None, kv_slots=None,
        backend="cudnn", rows="causal")
    _assert_same(attend, q, k, v, do, seg, tol=5e-2)


# ---------------------------------------------------------------------------------------------
# Splash, interpreted on CPU (compiled on a TPU).


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="splash is a TPU kernel")
def test_splash_matches_xla():
    """A causal row, a row of three packed positive documents then padding, an empty row;
    T pads to the block."""
    b, t, n, kv_heads, h = 3, 147, 15, 5, 13
    q, k, v, do = _inputs(1, b, t, n, kv_heads, h)
    packed = [1] * 50 + [2] * 51 + [3] * 30 + [0] * 16
    seg = jnp.asarray([[1] * t, packed, [0] * t], jnp.int32)
    attend = lambda q, k, v: splash_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg,  # noqa: E731
                                              interpret=jax.default_backend() == "cpu")
    _assert_same(attend, q, k, v, do, seg, tol=2e-5)
