"""Which kernels run NSA (``pallas_kernels.nsa.attention``, the one place that reads the
platform): per `kernels`, per platform, and per GPU generation."""

from types import SimpleNamespace

import jax
import pytest

from pallas_kernels.nsa.attention import branch_kernels, is_hopper, platform_kernel


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
