"""Which kernels run NSA (``pallas_kernels.nsa.attention``, the one place that reads the
platform): per `kernels`, per platform, and per GPU generation."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.nsa import reference as R
from pallas_kernels.nsa.attention import branch_kernels, is_hopper, platform_kernel, sliding_window_cudnn


def test_mosaic_kernels_only_from_hopper_on():
    """`model.nsa.gpu_kernels: mosaic` needs wgmma and TMA; older GPUs and ROCm keep Triton."""
    assert [is_hopper(SimpleNamespace(compute_capability=c)) for c in ("9.0", "10.0", "8.9", "gfx942")] == [
        True, True, False, False]
    assert not is_hopper(SimpleNamespace())  # CPU devices have no compute capability


@pytest.mark.parametrize(("capability", "want"), [("9.0", "mosaic"), ("8.0", "triton")])
def test_gpu_kernels_reach_all_three_branches(monkeypatch, capability, want):
    """On a GPU, `kernels: all` with `gpu_kernels: mosaic` hands each branch's kernel the Mosaic
    backend on Hopper and Triton before it (the kernels themselves are not called here)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(compute_capability=capability)])
    branches = branch_kernels("all", "mosaic")
    assert [fn.keywords for fn in branches] == [dict(interpret=False, gpu_kernels="mosaic")] * 3
    kernels = [platform_kernel(b, interpret=False, gpu_kernels="mosaic") for b in ("select", "window", "compressed")]
    assert [k.keywords["block_sizes"].backend for k in kernels] == [want] * 3
    assert not any(k.keywords["interpret"] for k in kernels)
    assert branch_kernels("select", "mosaic")[1:] == (None, None)


def test_platforms_pick_their_kernels(monkeypatch):
    """auto: the selected branch on GPU/TPU, plain XLA on CPU; TPU runs its Mosaic kernels;
    kernels asked for on CPU run the GPU-style (Triton) ones interpreted."""
    assert branch_kernels("auto") == (None, None, None)
    assert branch_kernels("xla") == (None, None, None)
    cpu = platform_kernel("select", interpret=True)
    assert cpu.func.__name__ == "select_attention_gpu" and cpu.keywords["block_sizes"].backend == "triton"
    assert [fn.keywords["interpret"] for fn in branch_kernels("all")] == [True] * 3
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    select, window, compressed = branch_kernels("auto")
    assert select.keywords["interpret"] is False and window is None and compressed is None
    assert [platform_kernel(b, interpret=False).func.__name__ for b in ("select", "window", "compressed")] == [
        "select_attention_tpu", "sliding_window_attention_tpu", "compressed_attention_tpu"]


@pytest.mark.parametrize(("capability", "gpu_kernels", "want"), [
    ("9.0", "auto", "hopper"), ("9.0", "mosaic", "hopper"), ("9.0", "triton", "select"), ("8.0", "auto", "select")])
def test_auto_on_hopper_runs_each_branch_on_its_fastest(monkeypatch, capability, gpu_kernels, want):
    """`kernels: auto` on a Hopper GPU: the selected and compressed branches on Mosaic GPU, the
    window on cuDNN (what an H200 timed fastest); `gpu_kernels: triton` or an older GPU keep the
    selected branch alone, on Triton."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(compute_capability=capability)])
    select, window, compressed = branch_kernels("auto", gpu_kernels)
    backend = platform_kernel("select", interpret=False, gpu_kernels=gpu_kernels).keywords["block_sizes"].backend
    if want == "hopper":
        assert window is sliding_window_cudnn and compressed.func.__name__ == "compressed_attention"
        assert backend == "mosaic"
        assert platform_kernel("compressed", interpret=False, gpu_kernels=gpu_kernels).keywords[
            "block_sizes"].backend == "mosaic"
    else:
        assert window is None and compressed is None and backend == "triton"
    assert select.keywords == dict(interpret=False, gpu_kernels=gpu_kernels)
    with pytest.raises(ValueError, match="gpu_kernels='cuda'"):
        platform_kernel("select", interpret=False, gpu_kernels="cuda")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dense_sliding_window_is_the_window_branch(dtype):
    """The cuDNN window call (run through XLA's implementation of the same call here; float32
    takes the banded fallback) against the float64 reference: keys t - w < s <= t, GQA."""
    rng = np.random.default_rng(7)
    b, t, n, kh, h, w = 2, 45, 6, 3, 16, 7
    q, k, v = (rng.normal(size=s) for s in [(b, t, n, h), (b, t, kh, h), (b, t, kh, h)])
    got = sliding_window_cudnn(*(jnp.asarray(x, dtype) for x in (q, k, v)), window=w, scale=0.3,
                               implementation="xla")
    assert got.dtype == dtype
    with jax.enable_x64(True):
        want = R.sliding_window_reference(*(jnp.asarray(x) for x in (q, k, v)), window=w, scale=0.3)
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_compiled_cudnn_window_matches_reference():
    """cuDNN's sliding window, compiled, forward and gradients, at the benchmark's layout."""
    rng = np.random.default_rng(8)
    b, t, n, kh, h, w = 1, 2048, 16, 1, 128, 512
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.bfloat16) for s in [(b, t, n, h), (b, t, kh, h), (b, t, kh, h)])
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v).astype(jnp.float32)))
    ours = lambda q, k, v: sliding_window_cudnn(q, k, v, window=w, scale=h**-0.5)
    ref = lambda q, k, v: R.sliding_window_reference(q.astype(jnp.float32), k.astype(jnp.float32),
                                                     v.astype(jnp.float32), window=w, scale=h**-0.5)
    np.testing.assert_allclose(np.asarray(jax.jit(ours)(q, k, v), np.float32), jax.jit(ref)(q, k, v), atol=3e-2)
    for a, e in zip(jax.jit(jax.grad(loss(ours), (0, 1, 2)))(q, k, v), jax.jit(jax.grad(loss(ref), (0, 1, 2)))(q, k, v)):
        np.testing.assert_allclose(np.asarray(a, np.float32), e, atol=0.15, rtol=0.05)
