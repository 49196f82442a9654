"""The decode-step kernel (split-K flash decoding) vs the float64 reference, on the cache layouts
the sampler makes: left padding, a previous turn then a gap, an empty tail, rows that see nothing,
negative ("sees all") segments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.doc_attention import decode_attention, doc_attention_reference
from pallas_kernels.doc_attention.decode import BlockSizes, _geometry


def caches(seed, b, s, n, kv_heads, h, dtype=np.float64):
    """One query per row at slot `index` of a cache of s slots, rows of distinct layouts."""
    rng = np.random.default_rng(seed)
    index = s - s // 4  # the empty tail: slots after it are free
    seg = np.zeros((b, s), np.int32)
    for row in range(b):
        kind = row % 5
        if kind == 0:  # a left-padded prompt, then generated tokens
            seg[row, rng.integers(0, index // 2):index + 1] = 1
        elif kind == 1:  # a previous turn, a gap of freed slots, this turn
            seg[row, 3:index // 3] = 1
            seg[row, index // 2:index + 1] = 1
        elif kind == 2:  # documents read by a "sees all" final section (the query's segment)
            seg[row, :index // 3], seg[row, index // 3:index // 2] = 1, 2
            seg[row, index // 2:index + 1] = -1
        elif kind == 3:  # a finished row whose query is padding: sees nothing
            seg[row, :index] = 1
        else:  # one visible slot only
            seg[row, index] = 1
    q_seg = seg[:, index:index + 1].copy()
    q_seg[np.arange(b) % 5 == 3] = 0
    slots = np.tile(np.arange(s, dtype=np.int32), (b, 1))
    ids = dict(q_segment_ids=q_seg, kv_segment_ids=seg, q_slots=np.full((b, 1), index, np.int32),
               kv_slots=slots)
    q = rng.standard_normal((b, 1, n, h)).astype(dtype)
    k, v = (rng.standard_normal((b, kv_heads, s, h)).astype(dtype) for _ in range(2))
    return q, k, v, ids


def reference(q, k, v, ids):
    with jax.enable_x64(True):
        return np.asarray(doc_attention_reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)),
                                                  **{n: jnp.asarray(x) for n, x in ids.items()}))


@pytest.mark.parametrize(("s", "block_sizes"), [
    (96, BlockSizes(block_k=16, programs=1)),  # one chunk: every block in one program
    (96, BlockSizes(block_k=16)),  # six chunks of one block, most of them empty for some rows
    (80, BlockSizes(block_k=64)),  # 80 = 5 x 16: the block shrinks to divide S
    (37, BlockSizes()),  # not a multiple of 16: padded with slots nothing sees
])
def test_matches_float64_reference(s, block_sizes):
    q, k, v, ids = caches(0, 5, s, 15, 3, 16)  # a row of each layout; G = 5 heads, padded to 16
    got = decode_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v)), **ids,
                           block_sizes=block_sizes, interpret=True)
    want = reference(q, k, v, ids)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[3].any()  # the padding query sees nothing: 0


def test_geometry_fills_the_gpu_and_divides_the_cache():
    """Chunks divide S's blocks and reach ~`programs` programs where S allows."""
    assert _geometry(64, 2, 640, BlockSizes()) == (128, 1)  # 128 programs from rows alone
    assert _geometry(1, 2, 640, BlockSizes()) == (128, 5)  # one row: one chunk per block
    assert _geometry(16, 2, 640, BlockSizes()) == (128, 5)
    assert _geometry(8, 2, 96, BlockSizes()) == (32, 3)


def test_one_query_per_row():
    q, k, v, ids = caches(1, 2, 32, 4, 2, 16)
    with pytest.raises(ValueError, match="one query per row, got 2"):
        decode_attention(jnp.concatenate([q, q], 1), k, v, **ids, interpret=True)


@pytest.mark.gpu
def test_compiled_kernel_matches_reference_at_the_sampler_layout():
    """Qwen2.5-0.5B's heads (14 query, 2 kv, dim 64), 64 rows, a 640-slot bucket, bf16."""
    q, k, v, ids = caches(2, 64, 640, 14, 2, 64)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    got = decode_attention(*bf16, **ids)
    want = reference(*(np.asarray(x, np.float64) for x in bf16), ids)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("b", "s", "n", "kv_heads", "h", "dtype"), [
    (64, 640, 14, 2, 64, jnp.bfloat16),  # Qwen2.5-0.5B's heads, 5 blocks, one chunk
    (3, 1152, 12, 2, 128, jnp.bfloat16),  # Qwen2.5-1.5B's, 9 blocks in 9 chunks
    (2, 200, 8, 8, 64, jnp.float32),  # no grouping, a cache padded to 208
])
def test_lowers_to_triton_for_a_gpu(b, s, n, kv_heads, h, dtype, lower):
    """The Triton lowering for an H100 (see conftest): power-of-two tiles, dynamic loop bounds,
    the scalar loads."""
    q, k, v, ids = caches(3, b, s, n, kv_heads, h)
    args = [jax.ShapeDtypeStruct(x.shape, dtype) for x in (q, k, v)]
    module = lower(lambda q, k, v: decode_attention(q, k, v, **ids), args)
    assert module.count("__gpu$xla.gpu.triton") == 1
