"""Native Sparse Attention (DeepSeek, arXiv 2502.11089) in XLA: the production path where no
Pallas kernel runs (CPU, ``model.nsa.kernels: xla``, and decoding and prefill over a KV cache
everywhere), and the building blocks the kernels and ``reference.py`` share.

Three branches per query t, combined by sigmoid gates (eq. 5):
  o_t = g_cmp * Attn(q_t, K_cmp, V_cmp) + g_slc * Attn(q_t, K_slc, V_slc) + g_win * Attn(q_t, K_win, V_win)
- compressed (eq. 7): blocks of l keys with stride d summarised by an MLP phi with intra-block
  position encoding; query t sees compressed block i once all its keys are in the past.
- selected (eqs. 8-12): block importance from the compressed attention probabilities, mapped
  onto selection blocks of size l' (eq. 9), summed over the heads of a GQA group (eq. 10); the
  top-n blocks, always including the first block and the local blocks, are attended in full.
- sliding window: the last w keys.
``nsa_forward`` is the layer for long sequences (each branch by cost, or a kernel in its
place), ``append_compressed`` and ``nsa_decode_step`` decode over a cache. Everything is
dtype-generic; tests compare it against ``reference.py`` in float64.

Letters: B batch, T query time, S key time, N query heads, K kv heads, G heads per kv head,
H key head dim, V value head dim, C compressed blocks, L compression block length,
F compression MLP hidden, J selected-block slots, P selection blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from pallas_kernels.nsa._index import clean_block_idx, pad_axis

NEG_INF = -jnp.inf


@dataclass(frozen=True)
class NSAShape:
    """NSA hyper-parameters; defaults are the paper's (section 4.1)."""

    compress_block: int = 32  # l: keys per compressed block
    compress_stride: int = 16  # d: stride between compressed blocks
    select_block: int = 64  # l': keys per selection block
    num_selected: int = 16  # n: selected blocks per query (incl. the forced ones)
    num_local_blocks: int = 2  # selection blocks ending at t that are always selected
    window: int = 512  # w: sliding-window length

    def __post_init__(self):
        if self.compress_block % self.compress_stride:
            raise ValueError(
                f"compress_block={self.compress_block} must be a multiple of "
                f"compress_stride={self.compress_stride}"
            )
        if self.select_block % self.compress_stride:
            raise ValueError(
                f"select_block={self.select_block} must be a multiple of "
                f"compress_stride={self.compress_stride}"
            )


def masked_softmax(s, mask, axis=-1):
    """Softmax of scores s over `axis` where mask (broadcast to s) holds; a row with no visible
    score gives zeros, not NaN."""
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=axis, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    denom = jnp.sum(p, axis=axis, keepdims=True)
    return p / jnp.where(denom > 0, denom, 1.0)


def attend(q, k, v, mask, scale):
    """Softmax attention with GQA: q[B,T,N,H], k[B,S,K,H], v[B,S,K,V], mask[B|1,T,K|1,S] -> [B,T,N,V].

    A query with no visible key outputs zeros.
    """
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    s = jnp.einsum("btkgh,bskh->btkgs", qg, k) * scale
    p = masked_softmax(s, mask[:, :, :, None, :])
    return jnp.einsum("btkgs,bskv->btkgv", p, v).reshape(b, t, n, v.shape[-1])


# --- compression (eq. 7) ------------------------------------------------------------------


def compress_blocks(x, params, shape: NSAShape):
    """x[B,S,K,H] -> [B,C,K,H]: phi over blocks x[i*d : i*d+l] for i = 0..floor((S-l)/d)."""
    l, d = shape.compress_block, shape.compress_stride
    c = max((x.shape[1] - l) // d + 1, 0)
    starts = jnp.arange(c) * d
    return compress(x[:, starts[:, None] + jnp.arange(l)[None, :]], params)  # blocks [B,C,L,K,H]


def compress(blocks, params):
    """phi: blocks of keys (or values) [B,C,L,K,H] -> one summary each [B,C,K,H]."""
    blocks = blocks + params["pos"][None, None, :, None, :]
    hidden = jax.nn.gelu(jnp.einsum("bclkh,lhf->bckf", blocks, params["w1"]))
    return jnp.einsum("bckf,fh->bckh", hidden, params["w2"])


def positions_of(t_len, offset=0):
    """Query positions [B|1,T]: offset (a scalar or [B]) + 0..T-1."""
    return jnp.reshape(jnp.asarray(offset), (-1, 1)) + jnp.arange(t_len)[None, :]


def compressed_mask(t_len, c_len, shape: NSAShape, offset=0):
    """[B|1,T,1,C]: compressed block i (keys i*d .. i*d+l-1) visible to query t iff i*d+l-1 <= t."""
    t = positions_of(t_len, offset)[:, :, None]
    last_key = jnp.arange(c_len) * shape.compress_stride + shape.compress_block - 1
    return (last_key <= t)[:, :, None, :]


def compressed_probs(q, k_cmp, mask, scale):
    """Per-head compressed attention probabilities p_cmp [B,T,N,C] (eq. 8); zero when masked."""
    b, t, n, h = q.shape
    kh = k_cmp.shape[2]
    s = jnp.einsum("btkgh,bckh->btkgc", q.reshape(b, t, kh, n // kh, h), k_cmp) * scale
    return masked_softmax(s, mask[:, :, :, None, :]).reshape(b, t, n, -1)


def eq9_weight(o, shape: NSAShape):
    """How many (m, n) pairs of eq. 9 have m - n = o: the weight of compressed block (l'/d) j + o
    in selection block j (an int, or an int array for an array o)."""
    ratio, span = shape.select_block // shape.compress_stride, shape.compress_block // shape.compress_stride
    return jnp.maximum(jnp.minimum(ratio, o + span) - jnp.maximum(o, 0), 0)


def selection_scores(p_cmp, num_select_blocks, shape: NSAShape):
    """Eq. 9: p_slc[j] = sum_{m < l'/d} sum_{n < l/d} p_cmp[(l'/d) j + m - n]  (zero out of range):
    selection block j (keys j*l' .. (j+1)*l'-1) collects every compressed block overlapping it,
    weighted by the overlap in units of d. With l = l' = d it is the identity."""
    d = shape.compress_stride
    ratio, span = shape.select_block // d, shape.compress_block // d
    # m - n = o takes each offset o in (-span, ratio) eq9_weight(o) times: a strided sum of shifted
    # slices, no gather (3.2x faster than the gather on XLA:CPU for [256 queries, 4 heads, 1k C]).
    p_len = ratio * num_select_blocks
    left = span - 1
    right = max(p_len + ratio - 1 - p_cmp.shape[-1], 0)
    padded = jnp.pad(p_cmp, [(0, 0)] * (p_cmp.ndim - 1) + [(left, right)])
    out = 0.0
    for o in range(-left, ratio):
        out = out + eq9_weight(o, shape) * padded[..., left + o : left + o + p_len : ratio]
    return out


def group_scores(p_slc, num_kv_heads):
    """Eq. 10: p_slc[B,T,N,P] summed over each GQA group -> [B,T,K,P]."""
    b, t, n, p = p_slc.shape
    return p_slc.reshape(b, t, num_kv_heads, n // num_kv_heads, p).sum(axis=3)


def top_n(score, j, form="top_k"):
    """The j largest of score[..., P], largest first, ties to the lower index: (values, indices).
    "top_k" is ``lax.top_k``; "argmax" takes j rounds of argmax, each knocking its pick out. On
    an H200 the rounds take 1.6 ms at 64k queries x 1,024 blocks where XLA's TopK kernel takes
    6.5 ms (0.60 vs 0.91 ms at 32k); on CPU top_k is 2-3x faster (benchmarks/top_n.py)."""
    if form == "top_k":
        return jax.lax.top_k(score, j)
    if form != "argmax":
        raise ValueError(f"top_n: form={form!r} is not 'top_k' or 'argmax'")
    blocks = jnp.arange(score.shape[-1])
    values, picks = [], []
    for _ in range(j):
        i = jnp.argmax(score, axis=-1)
        values.append(jnp.max(score, axis=-1))
        picks.append(i)
        score = jnp.where(blocks == i[..., None], -jnp.inf, score)
    return jnp.stack(values, axis=-1), jnp.stack(picks, axis=-1).astype(jnp.int32)


def top_blocks(score, shape: NSAShape, offset=0, top_n_form="top_k"):
    """Eqs. 11-12: group importance score[B,T,K,P] -> block_idx [B,T,K,J]: future blocks
    excluded, block 0 and the local blocks forced in, top-n (``top_n``'s `top_n_form`); -1 pads
    the slots of queries with fewer than n past blocks. Ties go to the lower block index."""
    t, p = score.shape[1], score.shape[-1]
    own = (positions_of(t, offset) // shape.select_block)[:, :, None, None]  # query t's block
    blk = jnp.arange(p)
    forced = (blk == 0) | ((blk <= own) & (blk > own - shape.num_local_blocks))
    score = jnp.where(forced, jnp.inf, score)
    score = jnp.where(blk <= own, score, NEG_INF)
    j = min(shape.num_selected, p)
    top, idx = top_n(score, j, top_n_form)
    idx = jnp.where(top > NEG_INF, idx, -1).astype(jnp.int32)
    if j < shape.num_selected:
        pad = jnp.full((*idx.shape[:-1], shape.num_selected - j), -1, jnp.int32)
        idx = jnp.concatenate([idx, pad], axis=-1)
    return idx


def select_blocks(p_slc, num_kv_heads, shape: NSAShape, offset=0):
    """p_slc[B,T,N,P] -> block_idx [B,T,K,J] (eqs. 10-12)."""
    return top_blocks(group_scores(p_slc, num_kv_heads), shape, offset)


def gates(q, w_gate):
    """Sigmoid gates per head and branch from the query: q[B,T,N,H], w[N,H,3] -> [B,T,N,3]."""
    return jax.nn.sigmoid(jnp.einsum("btnh,nhc->btnc", q, w_gate))


def compressed_attention_xla(q, k_cmp, v_cmp, *, shape: NSAShape, num_select_blocks, scale=None, offset=0):
    """The compressed branch and its by-product, in one pass over the compressed probabilities
    (eq. 9 as the strided sum of ``selection_scores``):
    q[B,T,N,H] at positions offset + t, k_cmp[B,C,K,H], v_cmp[B,C,K,V] ->
    (o_cmp [B,T,N,V] (eq. 7), block importance [B,T,K,P] (eqs. 9-10, no gradient))."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, t, n, _ = q.shape
    kh = k_cmp.shape[2]
    p = compressed_probs(q, k_cmp, compressed_mask(t, k_cmp.shape[1], shape, offset), scale)  # [B,T,N,C]
    o = jnp.einsum("btkgc,bckv->btkgv", p.reshape(b, t, kh, n // kh, -1), v_cmp).reshape(b, t, n, -1)
    score = group_scores(selection_scores(jax.lax.stop_gradient(p), num_select_blocks, shape), kh)
    return o, score


# --- fast plain-JAX formulations (gathered blocks, banded window, one decode step) ------------


def select_attention_gathered(
    q, k, v, block_idx, *, block_size, causal=True, scale=None, offset=0, chunk=256
):
    """select_attention_reference computed from the gathered blocks, O(T * n * block) instead of
    O(T * S); queries sit at positions offset + t. Queries go in chunks to bound the gather."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    pos = jnp.broadcast_to(positions_of(t, offset), (b, t))
    idx = clean_block_idx(block_idx, block_size=block_size, s_len=s_len, causal=False)
    as_blocks = lambda x: jnp.moveaxis(pad_axis(x, 1, block_size).reshape(b, -1, block_size, kh, x.shape[-1]), 3, 1)
    kb, vb = as_blocks(k), as_blocks(v)  # [B,K,P,bs,*]
    rows = min(chunk, t)
    qc, idc, pc = (pad_axis(x, 1, rows) for x in (q, idx, pos))
    split = lambda x: jnp.moveaxis(x.reshape(b, -1, rows, *x.shape[2:]), 1, 0)

    def one(args):
        q_c, idx_c, pos_c = args  # [B,R,N,H], [B,R,K,J], [B,R]
        # Kept kv-head-major ([B,K,R,...]) as the gather produces it: moving K of the gathered
        # blocks was a copy of n*l' keys per query, the largest cost on CPU.
        idx_c = jnp.swapaxes(idx_c, 1, 2)  # [B,K,R,J]
        take = jax.vmap(jax.vmap(lambda blocks, i: blocks[jnp.maximum(i, 0)]))  # over B, K
        ks, vs = take(kb, idx_c), take(vb, idx_c)  # [B,K,R,J,bs,*]
        key_pos = jnp.maximum(idx_c, 0)[..., None] * block_size + jnp.arange(block_size)  # [B,K,R,J,bs]
        ok = (idx_c[..., None] >= 0) & (key_pos < s_len)
        if causal:
            ok &= key_pos <= pos_c[:, None, :, None, None]
        qg = jnp.swapaxes(q_c.reshape(b, rows, kh, n // kh, h), 1, 2)  # [B,K,R,G,H]
        sc = jnp.einsum("bkrgh,bkrjsh->bkrgjs", qg, ks) * scale
        p = masked_softmax(sc, ok[:, :, :, None], axis=(-2, -1))  # over all selected keys
        out = jnp.einsum("bkrgjs,bkrjsv->bkrgv", p, vs)
        return jnp.swapaxes(out, 1, 2).reshape(b, rows, n, -1)

    out = jax.lax.map(one, (split(qc), split(idc), split(pc)))
    return jnp.moveaxis(out, 0, 1).reshape(b, -1, n, v.shape[-1])[:, :t]


def select_attention_masked(q, k, v, block_idx, *, block_size, causal=True, scale=None, offset=0, chunk=256):
    """select_attention_reference over all S keys with a block mask built by scatter, O(T * S):
    for short key sequences cheaper than gathering n * l' keys per query (on XLA:CPU a gathered
    key costs several dense ones). Queries sit at positions offset + t, in chunks of ``chunk``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    num_blocks = -(-s_len // block_size)
    rows = min(chunk, t)
    qc = pad_axis(q, 1, rows)
    idc = pad_axis(block_idx, 1, rows, value=-1)
    pos = pad_axis(jnp.broadcast_to(positions_of(t, offset), (b, t)), 1, rows)
    split = lambda x: jnp.moveaxis(x.reshape(b, -1, rows, *x.shape[2:]), 1, 0)
    key_pos = jnp.arange(s_len)

    def one(args):
        q_c, idx_c, pos_c = args  # [B,R,N,H], [B,R,K,J], [B,R]
        idx_c = jnp.where((idx_c >= 0) & (idx_c < num_blocks), idx_c, num_blocks)  # unused: dropped
        picked = jnp.zeros((*idx_c.shape[:3], num_blocks), bool)
        picked = picked.at[
            jnp.arange(b)[:, None, None, None], jnp.arange(rows)[None, :, None, None],
            jnp.arange(kh)[None, None, :, None], idx_c,
        ].set(True, mode="drop")  # [B,R,K,P]
        mask = jnp.repeat(picked, block_size, axis=-1)[..., :s_len]  # [B,R,K,S]
        if causal:
            mask &= (key_pos <= pos_c[:, :, None])[:, :, None, :]
        return attend(q_c, k, v, mask, scale)

    out = jax.lax.map(one, (split(qc), split(idc), split(pos)))
    return jnp.moveaxis(out, 0, 1).reshape(b, -1, n, v.shape[-1])[:, :t]


def select_attention_xla(q, k, v, block_idx, *, block_size, causal=True, scale=None, offset=0):
    """The plain-XLA selected branch, by cost: the masked form reads all S keys per query, the
    gathered form n * l' of them at several times the price each; masked up to S = 4 n l'."""
    dense = k.shape[1] <= 4 * block_idx.shape[-1] * block_size
    form = select_attention_masked if dense else select_attention_gathered
    return form(q, k, v, block_idx, block_size=block_size, causal=causal, scale=scale, offset=offset)


def sliding_window_banded(q, k, v, *, window, scale=None, offset=None):
    """sliding_window_reference in O(T * 2w): query chunk c of w rows sees key chunks c-1, c.

    With ``offset`` (a scalar or [B]) the queries sit at positions offset + t against keys at
    positions 0..S-1 (a prefill onto a cache); each chunk then gathers its 2w keys by position.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, t, n, h = q.shape
    s_len, kh, w = k.shape[1], k.shape[2], window
    qp = pad_axis(q, 1, w)
    c = qp.shape[1] // w
    base = jnp.zeros((b,), jnp.int32) if offset is None else jnp.broadcast_to(jnp.asarray(offset, jnp.int32), (b,))
    qpos = base[:, None, None] + jnp.arange(c * w).reshape(c, w)  # [B,C,w]
    kpos = qpos[:, :, :1] - w + jnp.arange(2 * w)  # [B,C,2w]: the chunk's first query - w ...
    if offset is None:  # keys line up with queries: the chunks are slices, no gather
        kp, vp = (jnp.pad(pad_axis(x, 1, w), ((0, 0), (w, 0), (0, 0), (0, 0))).reshape(b, c + 1, w, kh, -1)
                  for x in (k, v))
        keys, vals = (jnp.concatenate([x[:, :-1], x[:, 1:]], axis=2) for x in (kp, vp))  # [B,C,2w,K,*]
    else:
        at = jnp.clip(kpos, 0, s_len - 1).reshape(b, -1)
        keys, vals = (jnp.take_along_axis(x, at[:, :, None, None], axis=1).reshape(b, c, 2 * w, kh, -1)
                      for x in (k, v))
    ok = (kpos[:, :, None, :] <= qpos[..., None]) & (kpos[:, :, None, :] > qpos[..., None] - w)
    ok &= (kpos >= 0)[:, :, None, :] & (kpos < s_len)[:, :, None, :]  # [B,C,w,2w]
    qg = qp.reshape(b, c, w, kh, n // kh, h)
    sc = jnp.einsum("bcwkgh,bcskh->bcwkgs", qg, keys) * scale
    p = masked_softmax(sc, ok[:, :, :, None, None, :])  # a query before position 0 sees nothing
    out = jnp.einsum("bcwkgs,bcskv->bcwkgv", p, vals)
    return out.reshape(b, c * w, n, -1)[:, :t]


# --- decoding over a KV cache ------------------------------------------------------------------
# A model's cache keeps keys by slot, [B,K,S,*] (prompts are left-padded; multi-turn rows leave
# gaps), while NSA's blocks live in positions: slot_of[B,P] maps each position of a row to its slot.


def cache_keys(x, positions, slot_of=None):
    """x[B,K,S,*] at positions[B|1,K|1,P] -> [B,K,P,*]; slot_of None: slot = position. Positions
    out of range read a clipped slot: callers mask them."""
    b, kh, s_len = x.shape[:3]
    slots = jnp.broadcast_to(positions, (b, positions.shape[1], positions.shape[2]))
    if slot_of is not None:
        flat = jnp.clip(slots, 0, slot_of.shape[1] - 1).reshape(b, -1)
        slots = jnp.take_along_axis(slot_of, flat, axis=1).reshape(slots.shape)
    slots = jnp.broadcast_to(jnp.clip(slots, 0, s_len - 1), (b, kh, positions.shape[-1]))
    return jax.vmap(jax.vmap(lambda xs, i: xs[i]))(x, slots)


def probs_cached(q, k, mask, scale):
    """Attention probabilities of one query per row over keys in the cache layout: q[B,1,N,H],
    k[B,K,P,H], mask[B,K|1,P] -> [B,K,G,P] (zero where masked)."""
    b, _, n, h = q.shape
    kh = k.shape[1]
    # a dot: as multiply-and-reduce, XLA:CPU materialised q broadcast over P and ran 6x slower
    s = jnp.einsum("bkgh,bkph->bkgp", q.reshape(b, kh, n // kh, h), k) * scale
    return masked_softmax(s, mask[:, :, None])


def mix_cached(p, v):
    """p[B,K,G,P] over values v[B,K,P,V] -> [B,1,N,V]. Multiply-and-reduce: XLA:CPU vectorises
    it, while its dot with so few rows runs a naive loop."""
    b, kh, g, _ = p.shape
    return jnp.sum(p[..., None] * v[:, :, None], axis=-2).reshape(b, 1, kh * g, v.shape[-1])


def attend_cached(q, k, v, mask, scale):
    """``attend`` for one query per row over keys in the cache layout (see probs_cached)."""
    return mix_cached(probs_cached(q, k, mask, scale), v)


def append_compressed(cmp, x, slot_of, positions, segment_ids, params, shape: NSAShape):
    """Write into cmp[B,K,C,*] (block i at index i) the compressed blocks completed by a chunk of
    tokens already in the slot cache x[B,K,S,*]: positions/segment_ids [B,T], each row's real
    tokens (segment != 0) consecutive and last. A chunk of T tokens completes at most ceil(T/d)
    blocks per row, so decoding compresses one block every d steps instead of the whole cache."""
    l, d = shape.compress_block, shape.compress_stride
    b, t = positions.shape
    last = positions[:, -1]
    first = last - jnp.sum(segment_ids != 0, axis=1) + 1
    newest = last - jnp.mod(last - l + 1, d)  # the last position that closes a block
    ends = newest[:, None] - d * jnp.arange(-(-t // d))  # [B,M]
    ok = (ends >= first[:, None]) & (ends >= l - 1)
    block = jnp.where(ok, (ends - l + 1) // d, cmp.shape[2])  # out of range: dropped
    pos = (block * d)[:, :, None] + jnp.arange(l)  # [B,M,L]
    keys = jnp.swapaxes(cache_keys(x, pos.reshape(b, 1, -1), slot_of), 1, 2)  # [B,M*L,K,*]
    new = compress(keys.reshape(b, -1, l, *keys.shape[2:]), params)  # [B,M,K,*]
    return cmp.at[jnp.arange(b)[:, None], :, block].set(new.astype(cmp.dtype), mode="drop")


def nsa_decode_step(
    q, k_cache, v_cache, k_cmp, v_cmp, pos, params, shape: NSAShape, scale=None, slot_of=None, over_slots=None,
):
    """One decode step of the NSA layer: q[B,1,N,H] at position pos[B] over the slot caches
    k_cache[B,K,S,H], v_cache[B,K,S,V] (slot_of[B,P] maps positions to slots; None: the same)
    and the compressed caches k_cmp[B,K,C,H], v_cmp[B,K,C,V] (block i valid once i*d+l-1 <= pos).

    The selected and window branches either gather their O(n*l' + w) keys by position, never
    reading the whole cache, or (``over_slots``) score every slot once and mask by the position
    each slot holds: on XLA:CPU a gathered key costs several contiguous ones, so for caches up to
    S = 2 n l' reading them all is cheaper (None: choose by that size)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, _, n, _ = q.shape
    kh, s_len = k_cache.shape[1], k_cache.shape[2]
    lp, w = shape.select_block, shape.window
    p_cmp = probs_cached(q, k_cmp, compressed_mask(1, k_cmp.shape[2], shape, pos)[:, 0], scale)  # [B,K,G,C]
    o_cmp = mix_cached(p_cmp, v_cmp)
    num_pos = s_len if slot_of is None else slot_of.shape[1]
    p_slc = selection_scores(p_cmp.reshape(b, 1, n, -1), -(-num_pos // lp), shape)
    idx = select_blocks(p_slc, kh, shape, pos)[:, 0]  # [B,K,J]
    g = gates(q, params["gate"])
    if over_slots is None:
        over_slots = s_len <= 2 * shape.num_selected * lp
    if over_slots:
        return g[..., 0:1] * o_cmp + _selected_and_window_over_slots(q, k_cache, v_cache, idx, pos, slot_of, g, shape, scale)
    sel = (jnp.maximum(idx, 0)[..., None] * lp + jnp.arange(lp)).reshape(b, kh, -1)  # [B,K,J*l']
    sel_ok = jnp.repeat(idx >= 0, lp, axis=-1) & (sel <= pos[:, None, None])
    o_slc = attend_cached(q, cache_keys(k_cache, sel, slot_of), cache_keys(v_cache, sel, slot_of), sel_ok, scale)
    win = (pos - w + 1)[:, None, None] + jnp.arange(w)  # [B,1,w]
    o_win = attend_cached(q, cache_keys(k_cache, win, slot_of), cache_keys(v_cache, win, slot_of), win >= 0, scale)
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win


def _selected_and_window_over_slots(q, k_cache, v_cache, idx, pos, slot_of, g, shape: NSAShape, scale):
    """g_slc * o_slc + g_win * o_win of one decode step from one pass over all S slots: the two
    branches share q.K, each masks it by the positions the slots hold, and as the output is
    linear in V their gated probabilities meet in one p.V. -> [B,1,N,V]."""
    b, _, n, _ = q.shape
    kh, s_len = k_cache.shape[1], k_cache.shape[2]
    lp = shape.select_block
    if slot_of is None:
        slot_pos = jnp.broadcast_to(jnp.arange(s_len), (b, s_len))
    else:  # the position each slot holds, -1 if none (empty, padding, or not yet written)
        p = jnp.arange(slot_of.shape[1], dtype=jnp.int32)
        at = jnp.where(p[None, :] <= pos[:, None], slot_of, s_len)
        slot_pos = jnp.full((b, s_len), -1, jnp.int32).at[jnp.arange(b)[:, None], at].set(p, mode="drop")
    seen = (slot_pos >= 0) & (slot_pos <= pos[:, None])  # [B,S]
    num_blocks = -(-(slot_of.shape[1] if slot_of is not None else s_len) // lp)
    picked = jnp.zeros((b, kh, num_blocks + 1), bool)
    picked = picked.at[jnp.arange(b)[:, None, None], jnp.arange(kh)[None, :, None],
                       jnp.where(idx >= 0, idx, num_blocks)].set(True)[..., :num_blocks]  # [B,K,P]
    block = jnp.broadcast_to(jnp.clip(slot_pos // lp, 0, num_blocks - 1)[:, None], (b, kh, s_len))
    sel_ok = jnp.take_along_axis(picked, block, axis=-1) & seen[:, None]  # [B,K,S]
    win_ok = (seen & (slot_pos > (pos - shape.window)[:, None]))[:, None]  # [B,1,S]
    s = jnp.einsum("bkgh,bksh->bkgs", q.reshape(b, kh, n // kh, -1), k_cache) * scale  # q.K once for both
    gk = g.reshape(b, kh, n // kh, 3)[..., None]  # [B,K,G,3,1]
    weights = (gk[..., 1, :] * masked_softmax(s, sel_ok[:, :, None])
               + gk[..., 2, :] * masked_softmax(s, win_ok[:, :, None]))  # [B,K,G,S]
    return mix_cached(weights, v_cache)


def compressed_branch(q, k_cmp, v_cmp, shape: NSAShape, num_blocks, scale, compressed_fn=None, chunk=1024, offset=None,
                      top_n_form="top_k"):
    """The compressed branch and the selection it drives: (o_cmp [B,T,N,V], block_idx [B,T,K,J]).
    ``compressed_fn`` (the kernel) does a whole sequence at once; otherwise the compressed
    probabilities are computed per chunk of queries, so [T, N, C] is never whole."""
    if compressed_fn is not None and offset is None:
        o_cmp, score = compressed_fn(q, k_cmp, v_cmp, shape=shape, num_select_blocks=num_blocks, scale=scale)
        return o_cmp, top_blocks(score, shape, top_n_form=top_n_form)
    b, t, n, h = q.shape
    base = jnp.zeros((), jnp.int32) if offset is None else jnp.asarray(offset, jnp.int32)
    rows = min(chunk, t)

    def one(args):
        q_c, off = args
        off = base + off
        o, score = compressed_attention_xla(
            q_c, k_cmp, v_cmp, shape=shape, num_select_blocks=num_blocks, scale=scale, offset=off
        )
        return o, top_blocks(score, shape, off, top_n_form)

    qc = pad_axis(q, 1, rows)
    qc = jnp.moveaxis(qc.reshape(b, -1, rows, n, h), 1, 0)
    o_cmp, block_idx = jax.lax.map(one, (qc, jnp.arange(qc.shape[0]) * rows))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1, *x.shape[3:])[:, :t]
    return unchunk(o_cmp), unchunk(block_idx)


def nsa_forward(
    q, k, v, params, shape: NSAShape, scale=None, select_fn=None, window_fn=None, compressed_fn=None, chunk=1024,
    offset=None, k_cmp=None, v_cmp=None, top_n_form="top_k",
):
    """nsa_reference for long sequences: the compressed branch and the block scores come from one
    set of compressed probabilities (``compressed_branch``; ``compressed_fn``, the signature of
    compressed_attention_xla without offset, replaces its chunked form for a whole
    sequence); the selected branch runs ``select_fn`` (default: ``select_attention_xla``, masked
    or gathered by cost) and the window ``window_fn`` (default: the banded form). Same result as
    nsa_reference.

    With ``offset`` (a scalar or [B]) the queries sit at positions offset + t against keys at
    positions 0..S-1 (a KV cache; keys past a query are masked): the selected branch is then
    ``select_attention_xla`` and the window gathers each chunk's keys. ``k_cmp``/``v_cmp`` (a compressed
    cache, blocks masked by position as usual) replace compressing k and v. ``top_n_form``: how
    the top-n blocks are found (``top_n``; the same blocks either way).
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s_len = k.shape[1]
    base = jnp.zeros((), jnp.int32) if offset is None else jnp.asarray(offset, jnp.int32)
    if k_cmp is None:
        k_cmp = compress_blocks(k, params["compress_k"], shape)
        v_cmp = compress_blocks(v, params["compress_v"], shape)
    o_cmp, block_idx = compressed_branch(
        q, k_cmp, v_cmp, shape, -(-s_len // shape.select_block), scale, compressed_fn, chunk, offset, top_n_form
    )
    if offset is None:
        select_fn = select_fn or select_attention_xla
        o_slc = select_fn(q, k, v, block_idx, block_size=shape.select_block, causal=True, scale=scale)
        o_win = (window_fn or sliding_window_banded)(q, k, v, window=shape.window, scale=scale)
    else:
        o_slc = select_attention_xla(q, k, v, block_idx, block_size=shape.select_block, scale=scale, offset=base)
        o_win = sliding_window_banded(q, k, v, window=shape.window, scale=scale, offset=base)
    g = gates(q, params["gate"])
    return g[..., 0:1] * o_cmp + g[..., 1:2] * o_slc + g[..., 2:3] * o_win
