"""The document-attention kernel vs a float64 reference and vs the model's dense attention."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.doc_attention import (
    BlockSizes,
    block_visibility,
    doc_attention,
    doc_attention_reference,
    visible,
)
from pallas_kernels.doc_attention.xla import xla_attention

BLOCKS = BlockSizes(block_q=16, block_k=16)


def layout(name, t):
    """Segment ids [t] for a named layout; lengths are not multiples of the 16-token blocks."""
    seg = np.zeros(t, np.int32)
    if name == "documents":  # 3 documents of uneven length, then a final section
        seg[:7], seg[7:26], seg[26:29], seg[29:t - 3] = 1, 2, 3, -1
    elif name == "single_document":  # one document and its final section
        seg[:t - 8], seg[t - 8:t - 1] = 1, -1
    elif name == "empty_final":  # documents only
        seg[:11], seg[11:t] = 1, 2
    elif name == "shared_prompt":  # a GRPO group: prompt, completions 1..3
        seg[:13], seg[13:18], seg[18:19], seg[19:t - 4] = 1, -1, -2, -3
    return seg


def inputs(seed, t=41, n=6, kv_heads=2, h=16, names=("documents", "shared_prompt")):
    rng = np.random.default_rng(seed)
    seg = np.stack([layout(name, t) for name in names])
    b = len(names)
    slots = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    q = rng.standard_normal((b, t, n, h))
    k, v = (rng.standard_normal((b, kv_heads, t, h)) for _ in range(2))
    return q, k, v, seg, slots


def run(q, k, v, seg, slots, **kw):
    return doc_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_slots=slots,
                         kv_slots=slots, block_sizes=BLOCKS, interpret=True, **kw)


def float64_reference(q, k, v, seg, slots, do):
    """(out, dq, dk, dv) in float64."""
    with jax.enable_x64(True):
        f = lambda q, k, v: doc_attention_reference(q, k, v, seg, seg, slots, slots)  # noqa: E731
        out, vjp = jax.vjp(f, *(jnp.asarray(x, jnp.float64) for x in (q, k, v)))
        return [np.asarray(x) for x in (out, *vjp(jnp.asarray(do, jnp.float64)))]


def assert_close(got, want, tol):
    rel = np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max()
    assert rel < tol, rel


@pytest.mark.parametrize("names", [("documents", "shared_prompt"),
                                   ("single_document", "empty_final")])
def test_forward_and_gradients_match_float64_reference(names):
    q, k, v, seg, slots = inputs(seed=len(names[0]), names=names)
    do = np.random.default_rng(9).standard_normal(q.shape)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    out, vjp = jax.vjp(lambda *a: run(*a, seg, slots), *f32)
    grads = vjp(jnp.asarray(do, jnp.float32))
    for got, want in zip((out, *grads), float64_reference(q, k, v, seg, slots, do)):
        assert_close(got, want, 1e-5)


def test_equals_dense_attention_with_the_explicit_mask():
    q, k, v, seg, slots = (jnp.asarray(x, jnp.float32) if x.dtype == np.float64 else x
                           for x in inputs(seed=3, n=3, kv_heads=3))
    kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_slots=slots, kv_slots=slots)
    dense = lambda q, k, v: xla_attention(q, k, v, **kw)  # noqa: E731
    kernel = lambda q, k, v: run(q, k, v, seg, slots)  # noqa: E731
    np.testing.assert_allclose(kernel(q, k, v), dense(q, k, v), atol=2e-6)
    loss = lambda fn: lambda *a: (fn(*a) * jnp.cos(fn(*a))).sum()  # noqa: E731
    for g_kernel, g_dense in zip(jax.grad(loss(kernel), (0, 1, 2))(q, k, v),
                                 jax.grad(loss(dense), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(g_kernel, g_dense, atol=2e-5)


def prefill_over_a_cache(seed, b, t, s, n, kv_heads, h):
    """The sampler's prefill layout: left-padded prompts written at an offset into a cache whose
    earlier slots hold a previous turn and whose tail is empty. -> (q, k, v, ids and slots)."""
    rng = np.random.default_rng(seed)
    offset = s // 5
    q_slots = np.tile(np.arange(offset, offset + t, dtype=np.int32), (b, 1))
    kv_slots = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    pads = rng.integers(0, t // 2, b)
    q_seg = (np.arange(t)[None] >= pads[:, None]).astype(np.int32)
    kv_seg = np.zeros((b, s), np.int32)
    kv_seg[:, : offset // 2] = 1  # the previous turn, after its own left padding
    kv_seg[:, offset:offset + t] = q_seg
    q = rng.standard_normal((b, t, n, h))
    k, v = (rng.standard_normal((b, kv_heads, s, h)) for _ in range(2))
    return q, k, v, dict(q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_slots=q_slots,
                         kv_slots=kv_slots)


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_prefill_over_a_cache_matches_reference(gpu):
    """`auto`'s prefill on a GPU: the kernel over the cache layout against the reference
    (interpreted small here; compiled at the Qwen2.5-0.5B head layout with -m gpu)."""
    dims = (2, 300, 900, 14, 2, 64) if gpu else (3, 21, 53, 6, 2, 16)
    q, k, v, ids = prefill_over_a_cache(9, *dims)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    kw = {} if gpu else dict(block_sizes=BLOCKS, interpret=True)
    got = doc_attention(*f32, **ids, **kw)
    with jax.enable_x64(True):
        want = doc_attention_reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)),
                                       ids["q_segment_ids"], ids["kv_segment_ids"],
                                       ids["q_slots"], ids["kv_slots"])
    assert_close(got, np.asarray(want), 2e-3 if gpu else 1e-5)  # TF32 matmuls on the GPU


@pytest.mark.parametrize("query_chunk", [0, 8, 13])
def test_xla_attention_in_query_chunks_matches_reference(query_chunk):
    """The XLA path over a cache layout (left padding, a previous turn, T != S) with its queries
    whole and in chunks (37 queries: 5 chunks of 8 with 3 padding queries; 3 of 13), values and
    gradients against the float64 reference."""
    q, k, v, ids = prefill_over_a_cache(11, 3, 37, 61, 6, 2, 16)
    do = np.random.default_rng(12).standard_normal(q.shape)
    loss = lambda f: lambda q, k, v: (f(q, k, v) * do).sum()  # noqa: E731
    attend = lambda q, k, v: xla_attention(q, k, v, **ids, query_chunk=query_chunk)  # noqa: E731
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    got = [attend(*f32), *jax.jit(jax.grad(loss(attend), (0, 1, 2)))(*f32)]
    with jax.enable_x64(True):
        ref = lambda q, k, v: doc_attention_reference(  # noqa: E731
            q, k, v, ids["q_segment_ids"], ids["kv_segment_ids"], ids["q_slots"], ids["kv_slots"])
        f64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
        want = [ref(*f64), *jax.grad(loss(ref), (0, 1, 2))(*f64)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("query_chunk", [4, 7, 41])
def test_xla_attention_in_causal_bands_matches_reference(query_chunk):
    """An uncached call's chunks read only the keys up to their last query (`slots_are_indices`):
    packed documents and a shared-prompt group (negative segments see the documents before
    them) over 41 tokens in 11 chunks of 4 (6 bands of 2; the last band short), 6 of 7 (one a
    band) and one whole chunk; values and gradients against the float64 reference."""
    q, k, v, seg, slots = inputs(seed=13, names=("documents", "shared_prompt"))
    do = np.random.default_rng(14).standard_normal(q.shape)
    ids = dict(q_segment_ids=seg, kv_segment_ids=seg, q_slots=slots, kv_slots=slots)
    attend = lambda q, k, v: xla_attention(q, k, v, **ids, query_chunk=query_chunk,  # noqa: E731
                                           slots_are_indices=True)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    out, vjp = jax.vjp(attend, *f32)
    for got, want in zip((out, *vjp(jnp.asarray(do, jnp.float32))),
                         float64_reference(q, k, v, seg, slots, do)):
        assert_close(got, want, 1e-5)
    with pytest.raises(ValueError, match="slots_are_indices: 41 queries but 40 keys"):
        xla_attention(*f32[:1], k[:, :, :40], v[:, :, :40], q_segment_ids=seg,
                      kv_segment_ids=seg[:, :40], q_slots=slots, kv_slots=slots[:, :40],
                      slots_are_indices=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_backward_lower_to_triton_for_a_gpu(dtype, lower):
    """The compiled prefill test's layout (a 900-slot cache, not a power of two) lowers through
    Triton for an H100: forward, dq and dk/dv. The Mosaic GPU lowering (jax 0.10's default)
    staged the whole-row K/V blocks in shared memory, 540 KB in float32, and failed."""
    q, k, v, ids = prefill_over_a_cache(9, 2, 300, 900, 14, 2, 64)
    args = [jax.ShapeDtypeStruct(x.shape, dtype) for x in (q, k, v)]

    def fwd_bwd(q, k, v):
        out, back = jax.vjp(lambda q, k, v: doc_attention(q, k, v, **ids), q, k, v)
        return back(out)

    assert lower(fwd_bwd, args).count("__gpu$xla.gpu.triton") == 3


def test_block_visibility_covers_every_visible_entry_and_skips_documents():
    rng = np.random.default_rng(5)
    for _ in range(20):
        t = int(rng.integers(17, 90))
        seg = np.sort(rng.integers(1, 5, t)).astype(np.int32)  # contiguous documents
        tail = int(rng.integers(0, t // 3))
        seg[t - tail:] = -rng.integers(1, 3, tail)  # sees-all sections
        seg[rng.random(t) < 0.1] = 0  # padding anywhere
        pad = -t % 16
        seg = np.pad(seg, (0, pad))[None]
        slots = np.arange(t + pad, dtype=np.int32)[None]
        entries = np.asarray(visible(seg, seg, slots, slots))[0]
        vis = np.asarray(block_visibility(seg, seg, slots, slots, 16, 16))[0]
        blocks = entries.reshape(vis.shape[0], 16, vis.shape[1], 16).any((1, 3))
        assert not (blocks & ~vis.astype(bool)).any()  # nothing visible is skipped
    # Four 32-token documents: each sees only its own (causal) blocks, 3 of the 16 pairs per
    # document instead of the dense causal 10 of 16 pairs overall.
    seg = np.repeat(np.arange(1, 5, dtype=np.int32), 32)[None]
    slots = np.arange(128, dtype=np.int32)[None]
    assert int(block_visibility(seg, seg, slots, slots, 16, 16).sum()) == 4 * 3


def test_fully_masked_queries_give_zero_and_finite_gradients():
    q, k, v, seg, slots = inputs(seed=6)
    seg = seg.copy()
    seg[:, 5] = 0  # a padding query amid real ones
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    out = run(*f32, seg, slots)
    assert float(jnp.abs(out[:, 5]).max()) == 0.0
    grads = jax.grad(lambda *a: run(*a, seg, slots).sum(), (0, 1, 2))(*f32)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [64, 128])
def test_compiled_gpu_kernel_matches_reference(h):
    q, k, v, seg, slots = inputs(seed=7, t=1000, n=8, kv_heads=2, h=h)
    do = np.random.default_rng(8).standard_normal(q.shape)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    fn = lambda *a: doc_attention(*a, q_segment_ids=seg, kv_segment_ids=seg,  # noqa: E731
                                  q_slots=slots, kv_slots=slots)
    out, vjp = jax.vjp(fn, *f32)
    grads = vjp(jnp.asarray(do, jnp.float32))
    ref = jax.vjp(lambda *a: doc_attention_reference(*a, seg, seg, slots, slots), *f32)
    want = (ref[0], *ref[1](jnp.asarray(do, jnp.float32)))
    for got, w in zip((out, *grads), want):
        # TF32 matmuls on the GPU: a looser bound than the CPU float32 runs.
        assert_close(got, np.asarray(w, np.float64), 2e-3)
