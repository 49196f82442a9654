"""The plain-JAX NSA reference against direct NumPy transcriptions of the paper's formulas."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.nsa import reference as R
from pallas_kernels.nsa import xla as X


def _softmax_attention_np(q, k, v, mask, scale):
    b, t, n, _ = q.shape
    kh = k.shape[2]
    out = np.zeros((b, t, n, v.shape[-1]))
    for bi in range(b):
        for ti in range(t):
            for h in range(n):
                kv = h // (n // kh)
                keys = [s for s in range(k.shape[1]) if mask[bi, ti, kv, s]]
                if not keys:
                    continue
                s = np.array([q[bi, ti, h] @ k[bi, si, kv] * scale for si in keys])
                p = np.exp(s - s.max())
                p /= p.sum()
                out[bi, ti, h] = p @ v[bi, keys, kv]
    return out


def test_select_attention_reference_matches_loop():
    rng = np.random.default_rng(0)
    b, t, n, kh, h, vd, bs = 2, 11, 6, 2, 5, 7, 3
    q, k, v = rng.normal(size=(b, t, n, h)), rng.normal(size=(b, t, kh, h)), rng.normal(size=(b, t, kh, vd))
    idx = rng.integers(-1, 4, size=(b, t, kh, 2)).astype(np.int32)
    with jax.enable_x64(True):
        got = np.asarray(R.select_attention_reference(q, k, v, jnp.asarray(idx), block_size=bs, scale=0.3))
    mask = np.zeros((b, t, kh, t), bool)
    for bi, ti, ki, j in np.ndindex(*idx.shape):
        blk = idx[bi, ti, ki, j]
        if blk >= 0:
            for s in range(blk * bs, min((blk + 1) * bs, t)):
                mask[bi, ti, ki, s] = s <= ti
    np.testing.assert_allclose(got, _softmax_attention_np(q, k, v, mask, 0.3), atol=1e-12)


def test_compress_blocks_matches_loop():
    rng = np.random.default_rng(1)
    shape = X.NSAShape(compress_block=4, compress_stride=2, select_block=4)
    x = rng.normal(size=(2, 13, 3, 5))
    with jax.enable_x64(True):
        params = jax.tree.map(np.asarray, R.init_compress_params(jax.random.key(0), shape, 5, hidden=7, dtype=jnp.float64))
        got = np.asarray(X.compress_blocks(x, params, shape))
        c = (13 - 4) // 2 + 1
        assert got.shape == (2, c, 3, 5)
        for i in range(c):
            blk = x[:, 2 * i : 2 * i + 4] + params["pos"][None, :, None, :]  # [B,L,K,H]
            hid = np.einsum("blkh,lhf->bkf", blk, params["w1"])
            gelu = np.asarray(jax.nn.gelu(jnp.asarray(hid)))
            np.testing.assert_allclose(got[:, i], gelu @ params["w2"], atol=1e-12)


@pytest.mark.parametrize(("l", "d", "lp"), [(4, 4, 4), (4, 2, 4), (4, 2, 8), (8, 2, 4)])
def test_selection_scores_are_overlaps(l, d, lp):
    """Eq. 9: selection block j collects each compressed block's probability weighted by how many
    stride-d pieces of it fall inside block j."""
    shape = X.NSAShape(compress_block=l, compress_stride=d, select_block=lp)
    rng = np.random.default_rng(l * 100 + d * 10 + lp)
    c, p = 9, 5
    p_cmp = rng.random(size=(1, 1, 1, c))
    want = np.zeros(p)
    for j in range(p):
        for i in range(c):
            overlap = len(set(range(i * d, i * d + l)) & set(range(j * lp, (j + 1) * lp)))
            want[j] += p_cmp[0, 0, 0, i] * overlap / d
    # the production strided sum and the reference's literal double sum
    for scores in (X.selection_scores, R.selection_scores_reference):
        got = np.asarray(scores(jnp.asarray(p_cmp, jnp.float32), p, shape))[0, 0, 0]
        if l == d == lp:
            np.testing.assert_allclose(got, p_cmp[0, 0, 0, :p], rtol=1e-6)
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_select_blocks_forced_causal_group_summed_ties_low():
    shape = X.NSAShape(compress_block=4, compress_stride=4, select_block=4, num_selected=4, num_local_blocks=2)
    t, p = 30, 8
    score = np.zeros((1, t, 4, p), np.float32)
    score[0, :, 0, 3] = 1.0  # head 0 (group 0) likes block 3 ...
    score[0, :, 1, 5] = 2.0  # ... head 1 (group 0) likes block 5 more; heads 2, 3 tie everywhere
    idx = np.asarray(X.select_blocks(jnp.asarray(score), 2, shape))
    for ti in range(t):
        own = ti // 4
        for g in range(2):
            sel = [int(x) for x in idx[0, ti, g] if x >= 0]
            assert len(sel) == len(set(sel)) == min(4, own + 1)
            assert all(x <= own for x in sel)  # no future block
            assert 0 in sel and own in sel and (own < 1 or own - 1 in sel)
            forced = {0, own, max(own - 1, 0)}
            group_score = score[0, ti, 2 * g] + score[0, ti, 2 * g + 1]
            free = sorted((x for x in range(own + 1) if x not in forced), key=lambda x: (-group_score[x], x))
            assert sorted(sel) == sorted(forced | set(free[: 4 - len(forced)]))


def test_top_n_by_argmax_rounds_equals_top_k():
    """``top_n``'s argmax rounds (a GPU's form) give top_k's values and indices, largest first
    and ties to the lower index, on fresh scores with ties, +inf and -inf; the blocks
    ``top_blocks`` picks agree too."""
    rng = np.random.default_rng(11)
    score = rng.integers(0, 5, size=(3, 37, 2, 23)).astype(np.float32)  # many ties ...
    score += rng.random(score.shape) * (rng.random(score.shape) < 0.5)  # ... and as many not
    score[0, :, :, 4] = np.inf
    score[1, :, :, 7:] = -np.inf
    score = jnp.asarray(score)
    for j in (1, 6, 23):
        want = jax.lax.top_k(score, j)
        got = X.top_n(score, j, "argmax")
        np.testing.assert_array_equal(got[0], want[0])
        finite = np.asarray(want[0]) > -np.inf  # equal -inf picks: top_blocks turns them into -1
        np.testing.assert_array_equal(np.where(finite, got[1], -1), np.where(finite, want[1], -1))
    shape = X.NSAShape(compress_block=4, compress_stride=2, select_block=4, num_selected=5, num_local_blocks=2)
    blocks = jnp.asarray(rng.random((2, 90, 3, 23)), jnp.float32)
    np.testing.assert_array_equal(X.top_blocks(blocks, shape, top_n_form="argmax"), X.top_blocks(blocks, shape))
    with pytest.raises(ValueError, match="form='sort'"):
        X.top_n(score, 2, "sort")


def test_nsa_reference_float64_and_gradients():
    shape = X.NSAShape(compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=6)
    rng = np.random.default_rng(3)
    b, t, n, kh, h, vd = 1, 29, 6, 2, 8, 5
    with jax.enable_x64(True):
        q = jnp.asarray(rng.normal(size=(b, t, n, h)))
        k = jnp.asarray(rng.normal(size=(b, t, kh, h)))
        v = jnp.asarray(rng.normal(size=(b, t, kh, vd)))
        params = R.init_nsa_params(jax.random.key(1), shape, n, h, vd, dtype=jnp.float64)
        out = jax.jit(R.nsa_reference, static_argnums=4)(q, k, v, params, shape)  # eager float64 is slow
        assert out.dtype == jnp.float64 and out.shape == (b, t, n, vd)
        # The gated sum of the three branches, each recomputed from its own mask (one jitted
        # program: op by op, every eager float64 op compiles on its own).
        @jax.jit
        def gated_sum(q, k, v, params):
            g = jax.nn.sigmoid(jnp.einsum("btnh,nhc->btnc", q, params["gate"]))
            win = X.attend(q, k, v, R.sliding_window_mask(t, t, 6), 1 / math.sqrt(h))
            k_cmp = X.compress_blocks(k, params["compress_k"], shape)
            v_cmp = X.compress_blocks(v, params["compress_v"], shape)
            cmp = X.attend(q, k_cmp, v_cmp, X.compressed_mask(t, k_cmp.shape[1], shape), 1 / math.sqrt(h))
            idx = R.nsa_block_idx(q, k_cmp, shape, t, 1 / math.sqrt(h))
            slc = R.select_attention_reference(q, k, v, idx, block_size=8)
            return g[..., :1] * cmp + g[..., 1:2] * slc + g[..., 2:] * win

        np.testing.assert_allclose(out, gated_sum(q, k, v, params), atol=1e-12)
        grads = jax.jit(jax.grad(lambda p, q: jnp.sum(R.nsa_reference(q, k, v, p, shape) ** 2), (0, 1)))(params, q)
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(grads))
        assert all(float(jnp.abs(x).max()) > 0 for x in jax.tree.leaves(grads))


def test_gathered_and_banded_match_masked():
    """The fast selected forms (gathered, masked by scatter) and the banded window against the
    masked references, whole sequences and queries at offsets."""
    rng = np.random.default_rng(5)
    b, t, n, kh, h, vd = 2, 23, 6, 3, 4, 5
    reference = jax.jit(R.select_attention_reference, static_argnames=("block_size", "causal"))
    forms = [jax.jit(f, static_argnames=("block_size", "causal", "chunk"))
             for f in (X.select_attention_gathered, X.select_attention_masked)]
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(rng.normal(size=s)) for s in [(b, t, n, h), (b, t, kh, h), (b, t, kh, vd)])
        idx = jnp.asarray(rng.integers(-1, 6, size=(b, t, kh, 4)), jnp.int32)
        for causal in (True, False):
            want = reference(q, k, v, idx, block_size=4, causal=causal)
            for form in forms:
                np.testing.assert_allclose(form(q, k, v, idx, block_size=4, causal=causal, chunk=7), want, atol=1e-12)
        # queries at positions 17.. of row 0 and 9.. of row 1 (a prefill onto a cache), and one
        # query at position 17, as in decoding
        full = reference(q, k, v, idx, block_size=4, causal=True)
        for form in forms:
            part = form(jnp.stack([q[0, 17:21], q[1, 9:13]]), k, v, jnp.stack([idx[0, 17:21], idx[1, 9:13]]),
                        block_size=4, offset=jnp.array([17, 9]), chunk=3)
            np.testing.assert_allclose(part[0], full[0, 17:21], atol=1e-12)
            np.testing.assert_allclose(part[1], full[1, 9:13], atol=1e-12)
            last = form(q[:, 17:18], k, v, idx[:, 17:18], block_size=4, offset=jnp.array([17, 17]))
            np.testing.assert_allclose(last, full[:, 17:18], atol=1e-12)
        banded = jax.jit(X.sliding_window_banded, static_argnames="window")
        window = jax.jit(R.sliding_window_reference, static_argnames="window")
        for w in (1, 5, 30):
            np.testing.assert_allclose(banded(q, k, v, window=w), window(q, k, v, window=w), atol=1e-12)


def test_banded_window_at_offsets_matches_the_full_sequence():
    """A prefill onto a cache: row 0's queries sit at positions 13..22, row 1's at -4..5 (four
    left-padding queries that see nothing and give zeros)."""
    rng = np.random.default_rng(9)
    b, t, n, kh, h, vd = 2, 23, 4, 2, 3, 5
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(rng.normal(size=s)) for s in [(b, t, n, h), (b, t, kh, h), (b, t, kh, vd)])
        q_off = jnp.stack([q[0, 13:], jnp.concatenate([jnp.asarray(rng.normal(size=(4, n, h))), q[1, :6]])])
        reference = jax.jit(R.sliding_window_reference, static_argnames="window")
        banded = jax.jit(X.sliding_window_banded, static_argnames="window")
        for w in (1, 4, 30):
            full = reference(q, k, v, window=w)
            got = banded(q_off, k, v, window=w, offset=jnp.array([13, -4]))
            np.testing.assert_allclose(got[0], full[0, 13:], atol=1e-12)
            np.testing.assert_allclose(got[1], jnp.concatenate([jnp.zeros((4, n, vd)), full[1, :6]]), atol=1e-12)


SMALL = X.NSAShape(compress_block=8, compress_stride=4, select_block=8, num_selected=3, window=6)


def _layer_inputs(seed, b, t, n=4, kh=2, h=8, vd=6):
    """float64 q, k, v and NSA parameters (call under jax.enable_x64)."""
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.normal(size=s)) for s in [(b, t, n, h), (b, t, kh, h), (b, t, kh, vd)])
    return q, k, v, R.init_nsa_params(jax.random.key(seed), SMALL, n, h, vd, dtype=jnp.float64)


def _slot_cache(x, slot_of, size):
    """Position-space x[B,T,K,*] laid into a slot cache [B,K,size,*] by slot_of[B,T]; every
    other slot holds junk that decoding must not read."""
    b, t = slot_of.shape
    cache = jnp.full((b, size, *x.shape[2:]), 1e3, x.dtype)
    cache = cache.at[jnp.arange(b)[:, None], slot_of].set(x)
    return jnp.swapaxes(cache, 1, 2)


def _scattered_slots(rng, b, t, size):
    """An increasing position -> slot map per row, with gaps (left padding, forgotten slots)."""
    return jnp.asarray(np.stack([np.sort(rng.choice(size, t, replace=False)) for _ in range(b)]), jnp.int32)


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("over_slots", [False, True], ids=["gathered", "over_slots"])
def test_decode_steps_match_teacher_forced_layer(scattered, over_slots):
    shape, b, t = SMALL, 2, 27
    with jax.enable_x64(True):
        q, k, v, params = _layer_inputs(6, b, t)
        full = jax.jit(R.nsa_reference, static_argnums=4)(q, k, v, params, shape)
        k_cmp = X.compress_blocks(k, params["compress_k"], shape)
        v_cmp = X.compress_blocks(v, params["compress_v"], shape)
        decode_step = jax.jit(functools.partial(X.nsa_decode_step, over_slots=over_slots), static_argnums=7)
        size = 40 if scattered else t
        slot_of = _scattered_slots(np.random.default_rng(1), b, t, size) if scattered else None
        place = lambda x: _slot_cache(x, slot_of if scattered else jnp.broadcast_to(jnp.arange(t), (b, t)), size)
        for pos in (0, 5, 11, 26):
            # the caches beyond pos hold garbage: decoding must not read it
            junk = lambda x, valid: jnp.where(jnp.arange(x.shape[1])[None, :, None, None] < valid, x, 1e3)
            n_cmp = max((pos + 1 - 8) // 4 + 1, 0)
            step = decode_step(
                q[:, pos : pos + 1], place(junk(k, pos + 1)), place(junk(v, pos + 1)),
                jnp.swapaxes(junk(k_cmp, n_cmp), 1, 2), jnp.swapaxes(junk(v_cmp, n_cmp), 1, 2),
                jnp.full((b,), pos), params, shape, slot_of=slot_of,
            )
            np.testing.assert_allclose(step, full[:, pos : pos + 1], atol=1e-10)


def test_append_compressed_builds_the_compressed_cache_chunk_by_chunk():
    """A left-padded prefill chunk, then one token per step, in scattered slots: every block the
    tokens complete is written, equal to compressing the whole sequence; nothing else is."""
    shape, b, t = SMALL, 2, 27
    rng = np.random.default_rng(3)
    k = jnp.asarray(rng.normal(size=(b, t, 2, 8)), jnp.float32)
    params = R.init_compress_params(jax.random.key(0), shape, 8)
    slot_of = _scattered_slots(rng, b, t, 45)
    cache = _slot_cache(k, slot_of, 45)
    want = jnp.swapaxes(X.compress_blocks(k, params, shape), 1, 2)  # [B,K,5,H]
    cmp = jnp.full((b, 2, 11, 8), -7.0)
    # prefill: row 0 has 13 real tokens, row 1 has 9, left-padded to 16
    lengths = np.array([13, 9])
    seg = (np.arange(16)[None, :] >= 16 - lengths[:, None]).astype(np.int32)
    pos = np.where(seg, np.arange(16)[None, :] - (16 - lengths[:, None]), 0)
    append = jax.jit(X.append_compressed, static_argnums=6)
    cmp = append(cmp, cache, slot_of, jnp.asarray(pos), jnp.asarray(seg), params, shape)
    for row, n in enumerate(lengths):  # blocks ending at 7 and 11 (l=8, d=4) are complete by 12
        done = (n - 8) // 4 + 1
        np.testing.assert_allclose(cmp[row, :, :done], want[row, :, :done], rtol=1e-5, atol=1e-6)
        assert bool(jnp.all(cmp[row, :, done:] == -7.0))
    for p in range(int(lengths.min()), t):
        rows = p >= lengths  # rows whose prefill did not cover p take a decode step
        cmp_next = append(cmp, cache, slot_of, jnp.full((b, 1), p), jnp.ones((b, 1), jnp.int32), params, shape)
        cmp = jnp.where(jnp.asarray(rows)[:, None, None, None], cmp_next, cmp)
    np.testing.assert_allclose(cmp[:, :, :5], want, rtol=1e-5, atol=1e-6)
    assert bool(jnp.all(cmp[:, :, 5:] == -7.0))


def test_chunked_nsa_forward_matches_reference_values_and_grads():
    shape = SMALL
    with jax.enable_x64(True):
        q, k, v, params = _layer_inputs(7, 1, 29)
        want = jax.jit(R.nsa_reference, static_argnums=4)(q, k, v, params, shape)
        got = jax.jit(functools.partial(X.nsa_forward, chunk=8), static_argnums=4)(q, k, v, params, shape)
        np.testing.assert_allclose(got, want, atol=1e-12)
        loss = lambda f: lambda p, q, k, v: jnp.sum(jnp.sin(f(q, k, v, p, shape)))
        got_g = jax.jit(jax.grad(loss(functools.partial(X.nsa_forward, chunk=8)), (0, 1, 2, 3)))(params, q, k, v)
        want_g = jax.jit(jax.grad(loss(R.nsa_reference), (0, 1, 2, 3)))(params, q, k, v)
        for a, w in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
            np.testing.assert_allclose(a, w, atol=1e-10)


@pytest.mark.parametrize("seed", [21, 22])
def test_xla_path_matches_the_reference_at_odd_sizes(seed):
    """The production XLA path (xla.py) against the plain oracle (reference.py) on fresh inputs
    with odd sizes: the compressed branch and its importance (at offsets), and the whole layer
    with the selected branch in both XLA forms and the compressed branch in query chunks."""
    rng = np.random.default_rng(seed)
    shape = X.NSAShape(compress_block=6, compress_stride=3, select_block=9, num_selected=3,
                       num_local_blocks=1, window=5)
    b, t, n, kh, h, vd = 3, 31, 6, 3, 5, 7
    with jax.enable_x64(True):
        q, k, v = (jnp.asarray(rng.normal(size=s)) for s in [(b, t, n, h), (b, t, kh, h), (b, t, kh, vd)])
        params = R.init_nsa_params(jax.random.key(seed), shape, n, h, vd, dtype=jnp.float64)
        k_cmp = X.compress_blocks(k, params["compress_k"], shape)
        v_cmp = X.compress_blocks(v, params["compress_v"], shape)
        blocks = -(-t // shape.select_block)
        for offset in (0, 5):
            got = X.compressed_attention_xla(q, k_cmp, v_cmp, shape=shape, num_select_blocks=blocks,
                                             offset=offset)
            want = R.compressed_attention_reference(q, k_cmp, v_cmp, shape=shape,
                                                    num_select_blocks=blocks, offset=offset)
            for a, w in zip(got, want):
                np.testing.assert_allclose(a, w, atol=1e-12)
        want = R.nsa_reference(q, k, v, params, shape)
        for select_fn, top_n_form in ((X.select_attention_masked, "top_k"), (X.select_attention_gathered, "top_k"),
                                      (X.select_attention_masked, "argmax")):
            got = X.nsa_forward(q, k, v, params, shape, select_fn=select_fn, chunk=7, top_n_form=top_n_form)
            np.testing.assert_allclose(got, want, atol=1e-12)


@pytest.mark.slow
def test_nsa_forward_at_an_offset_matches_the_full_sequence():
    """Queries at positions 12..19 of each row against a 24-key cache (keys past 19 are junk)."""
    shape = SMALL
    with jax.enable_x64(True):
        q, k, v, params = _layer_inputs(8, 2, 20)
        want = R.nsa_reference(q, k, v, params, shape)[:, 12:]
        junk = lambda x: jnp.concatenate([x, 1e3 * jnp.ones_like(x[:, :4])], axis=1)
        got = X.nsa_forward(q[:, 12:], junk(k), junk(v), params, shape, chunk=3, offset=jnp.array([12, 12]))
        np.testing.assert_allclose(got, want, atol=1e-10)
