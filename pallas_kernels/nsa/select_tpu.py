"""Selected-block attention (NSA's selected branch), TPU-style Pallas kernels (Mosaic TPU).

The block indices are data: they go to scalar memory through ``PrefetchScalarGridSpec`` and the
BlockSpec index maps read them, so the pipeline DMAs exactly the chosen key blocks.
- forward and dQ: grid (batch, kv head, query, slot); the G query heads of one kv group are one
  [G, H] tile and the innermost "arbitrary" slot axis walks the query's selected blocks with an
  online softmax held in VMEM scratch.
- dK/dV: grid (batch, kv head, pair) over the (query, block) pairs sorted by block -- the
  inverted index flattened -- so consecutive steps revisit the same dK/dV block, which stays
  resident and is written back once per run: deterministic, no atomics.
Scalar memory is small, so the index arrays are cut into chunks of at most
``BlockSizes.max_scalar_prefetch`` entries and the kernels run once per chunk (dK/dV chunks
accumulate through an aliased output).

Letters: B batch, T query time, S key time, N query heads, K kv heads, G heads per kv head,
H key head dim, V value head dim, J selected-block slots, P key blocks, R pairs (query, block).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.nsa._index import Geometry, clean_block_idx, online_softmax, pad_axis, visible_keys


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    max_scalar_prefetch: int = 1 << 14  # int32 entries per index chunk in scalar memory


def _interpret(interpret):
    return pltpu.InterpretParams() if interpret else False


def flash_init(m_sc, l_sc, acc_sc):
    """Reset the online-softmax scratch (running max, sum, output) before a row's first tile."""
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)


def flash_finish(m_sc, l_sc, acc_sc, o_ref, lse_ref):
    """Normalise the output after a row's last tile and store its log-sum-exp, a [rows, 1]
    column: Mosaic takes a block whose last two dims are (rows, 1) of a [..., rows, 1] array,
    not a 1-D block under squeezed dims."""
    l = l_sc[...]
    seen = l > 0
    o_ref[...] = (acc_sc[...] / jnp.where(seen, l, 1.0)).astype(o_ref.dtype)
    # no visible key: lse = +inf makes the backward's exp(s - lse) vanish
    lse_ref[...] = jnp.where(seen, m_sc[...] + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)


def _slot(idx_ref):
    """This grid step's query row r, slot j (of nj) and the block it selects (-1: none)."""
    b, h, r, j = (pl.program_id(a) for a in range(4))
    nk, nr, nj = pl.num_programs(1), pl.num_programs(2), pl.num_programs(3)
    return r, j, nj, idx_ref[((b * nk + h) * nr + r) * nj + j]


def _fwd_kernel(
    idx_ref, off_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc,
    *, block_size, s_len, causal, scale,
):
    r, j, nj, blk = _slot(idx_ref)

    pl.when(j == 0)(lambda: flash_init(m_sc, l_sc, acc_sc))

    @pl.when(blk >= 0)
    def _step():
        start = blk * block_size
        q = q_ref[...].astype(jnp.float32) * scale  # [G,H]
        ok = visible_keys(blk, start, off_ref[0] + r, s_len, block_size, causal)[None, :]
        s = jnp.where(ok, jnp.dot(q, k_ref[...].astype(jnp.float32).T), -jnp.inf)  # [G,bs]
        m_sc[...], l_sc[...], acc_sc[...] = online_softmax(
            m_sc[...], l_sc[...], acc_sc[...], s, ok, lambda p: jnp.dot(p, v_ref[...].astype(jnp.float32)))

    pl.when(j == nj - 1)(lambda: flash_finish(m_sc, l_sc, acc_sc, o_ref, lse_ref))


def _dq_kernel(
    idx_ref, off_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_sc,
    *, block_size, s_len, causal, scale,
):
    r, j, nj, blk = _slot(idx_ref)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(blk >= 0)
    def _step():
        start = blk * block_size
        q = q_ref[...].astype(jnp.float32) * scale
        k = k_ref[...].astype(jnp.float32)
        ok = visible_keys(blk, start, off_ref[0] + r, s_len, block_size, causal)[None, :]
        p = jnp.where(ok, jnp.exp(jnp.dot(q, k.T) - lse_ref[...]), 0.0)
        dp = jnp.dot(do_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32).T)
        ds = p * (dp - delta_ref[...])
        dq_sc[...] += jnp.dot(ds, k)

    @pl.when(j == nj - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _dkdv_kernel(
    query_ref, block_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_in, dv_in,
    dk_ref, dv_ref, *, block_size, s_len, causal, scale,
):
    b, h, i = (pl.program_id(a) for a in range(3))
    nk, ni = pl.num_programs(1), pl.num_programs(2)
    at = (b * nk + h) * ni + i
    t, c = query_ref[at], block_ref[at]
    new_run = (i == 0) | (block_ref[jnp.maximum(at - 1, 0)] != c)

    @pl.when(new_run)
    def _init():  # the block's sum so far (earlier chunks), read through the aliased input
        dk_ref[...] = dk_in[...]
        dv_ref[...] = dv_in[...]

    @pl.when(t >= 0)
    def _step():
        start = c * block_size
        q = q_ref[...].astype(jnp.float32) * scale  # [G,H]
        k = k_ref[...].astype(jnp.float32)  # [bs,H]
        do = do_ref[...].astype(jnp.float32)  # [G,V]
        ok = visible_keys(c, start, t, s_len, block_size, causal)[None, :]
        p = jnp.where(ok, jnp.exp(jnp.dot(q, k.T) - lse_ref[...]), 0.0)  # [G,bs]
        ds = p * (jnp.dot(do, v_ref[...].astype(jnp.float32).T) - delta_ref[...])
        dk_ref[...] += jnp.dot(ds.T, q).astype(dk_ref.dtype)
        dv_ref[...] += jnp.dot(p.T, do).astype(dv_ref.dtype)


def _statics(g: Geometry):
    return {"block_size": g.block_size, "s_len": g.s_len, "causal": g.causal, "scale": g.scale}


def _row_chunk(g: Geometry, b, kh, j):
    """Query rows per chunk so that one chunk's index array fits the scalar-memory budget."""
    return max(1, min(g.t_len, g.block_sizes.max_scalar_prefetch // (b * kh * j)))


def _chunked_rows(x, rows, value=0):
    """[B,K,T,...] -> [C,B,K,rows,...] (T padded with value to a multiple of rows)."""
    x = pad_axis(x, 2, rows, value)
    c = x.shape[2] // rows
    x = x.reshape(*x.shape[:2], c, rows, *x.shape[3:])
    return jnp.moveaxis(x, 2, 0)


def _unchunk_rows(x, t_len):
    """[C,B,K,rows,...] -> [B,K,T,...]."""
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape(*x.shape[:2], -1, *x.shape[4:])[:, :, :t_len]


def _row_specs(gsz, dims):
    """BlockSpecs for [B,K,rows,G,*] tiles of one query row (index maps take the prefetch refs)."""
    return [pl.BlockSpec((None, None, None, gsz, d), lambda b, h, r, j, *_: (b, h, r, 0, 0)) for d in dims]


def _kv_specs(g: Geometry, dims, grid):
    """BlockSpecs for the key block a slot selects; unused slots point at block 0 (masked)."""
    _, nk, nr, nj = grid

    def index(b, h, r, j, idx_ref, _off):
        return (b, h, jnp.maximum(idx_ref[((b * nk + h) * nr + r) * nj + j], 0), 0)

    return [pl.BlockSpec((None, None, g.block_size, d), index) for d in dims]


def _lse_spec(gsz):
    """A query row's [G, 1] column of log-sum-exp (or delta) in a [B,K,rows,G,1] array."""
    return pl.BlockSpec((None, None, None, gsz, 1), lambda b, h, r, j, *_: (b, h, r, 0, 0))


def _forward(qg, k, v, idx, g: Geometry, interpret):
    """qg [B,K,T,G,H], k/v [B,K,P*bs,H|V], idx [B,K,T,J] -> o [B,K,T,G,V], lse [B,K,T,G,1]."""
    b, kh, t, gsz, hd = qg.shape
    vd, j = v.shape[-1], idx.shape[-1]
    rows = _row_chunk(g, b, kh, j)
    grid = (b, kh, rows, j)

    def chunk(args):
        q_c, idx_c, off = args
        call = pl.pallas_call(
            functools.partial(_fwd_kernel, **_statics(g)),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2,
                grid=grid,
                in_specs=[*_row_specs(gsz, [hd]), *_kv_specs(g, [hd, vd], grid)],
                out_specs=[*_row_specs(gsz, [vd]), _lse_spec(gsz)],
                scratch_shapes=[
                    pltpu.VMEM((gsz, 1), jnp.float32),
                    pltpu.VMEM((gsz, 1), jnp.float32),
                    pltpu.VMEM((gsz, vd), jnp.float32),
                ],
            ),
            out_shape=[
                jax.ShapeDtypeStruct((b, kh, rows, gsz, vd), qg.dtype),
                jax.ShapeDtypeStruct((b, kh, rows, gsz, 1), jnp.float32),
            ],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
            ),
            interpret=_interpret(interpret),
            name="nsa_select_fwd_tpu",
        )
        return call(idx_c.reshape(-1), off, q_c, k, v)

    q_ch, idx_ch = _chunked_rows(qg, rows), _chunked_rows(idx, rows, value=-1)
    offs = (jnp.arange(q_ch.shape[0], dtype=jnp.int32) * rows)[:, None]
    o, lse = jax.lax.map(chunk, (q_ch, idx_ch, offs))
    return _unchunk_rows(o, t), _unchunk_rows(lse, t)


def _dq(qg, k, v, idx, do, lse, delta, g: Geometry, interpret):
    b, kh, t, gsz, hd = qg.shape
    vd, j = v.shape[-1], idx.shape[-1]
    rows = _row_chunk(g, b, kh, j)
    grid = (b, kh, rows, j)

    def chunk(args):
        q_c, idx_c, do_c, lse_c, delta_c, off = args
        call = pl.pallas_call(
            functools.partial(_dq_kernel, **_statics(g)),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=2,
                grid=grid,
                in_specs=[
                    *_row_specs(gsz, [hd]),
                    *_kv_specs(g, [hd, vd], grid),
                    *_row_specs(gsz, [vd]),
                    _lse_spec(gsz),
                    _lse_spec(gsz),
                ],
                out_specs=_row_specs(gsz, [hd])[0],
                scratch_shapes=[pltpu.VMEM((gsz, hd), jnp.float32)],
            ),
            out_shape=jax.ShapeDtypeStruct((b, kh, rows, gsz, hd), qg.dtype),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
            ),
            interpret=_interpret(interpret),
            name="nsa_select_dq_tpu",
        )
        return call(idx_c.reshape(-1), off, q_c, k, v, do_c, lse_c, delta_c)

    ch = [_chunked_rows(x, rows) for x in (qg, do, lse, delta)]
    ch.insert(1, _chunked_rows(idx, rows, value=-1))
    offs = (jnp.arange(ch[0].shape[0], dtype=jnp.int32) * rows)[:, None]
    return _unchunk_rows(jax.lax.map(chunk, (*ch, offs)), t)


def _sorted_pairs(idx, num_blocks):
    """The inverted index, flat: (query, block) pairs [B,K,R] sorted by block (queries ascending
    within a block); unused slots become (-1, num_blocks) and sort last."""
    b, kh, t, j = idx.shape
    block = jnp.where(idx >= 0, idx, num_blocks).reshape(b, kh, t * j)
    query = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], (t, j)).reshape(t * j)
    order = jnp.argsort(block, axis=-1, stable=True)
    block = jnp.take_along_axis(block, order, -1).astype(jnp.int32)
    query = jnp.where(block < num_blocks, query[order], -1).astype(jnp.int32)
    return query, block


def _dkdv(qg, k, v, idx, do, lse, delta, g: Geometry, interpret):
    b, kh, _t, gsz, hd = qg.shape
    vd = v.shape[-1]
    bs, nb = g.block_size, g.num_blocks
    query, block = _sorted_pairs(idx, nb)
    pairs = max(1, min(query.shape[-1], g.block_sizes.max_scalar_prefetch // (2 * b * kh)))
    query = pad_axis(query, 2, pairs, value=-1)
    block = pad_axis(block, 2, pairs, value=nb)
    n_chunks = query.shape[-1] // pairs
    split = lambda x: jnp.moveaxis(x.reshape(b, kh, n_chunks, pairs), 2, 0)

    def at_query(b_, h, i, q_ref, _blk):
        return (b_, h, jnp.maximum(q_ref[(b_ * kh + h) * pairs + i], 0))

    def row(b_, h, i, q_ref, blk_ref):
        return (*at_query(b_, h, i, q_ref, blk_ref), 0, 0)

    def lse_row(b_, h, i, q_ref, blk_ref):
        return (*at_query(b_, h, i, q_ref, blk_ref), 0, 0)

    def key_block(last):
        def index(b_, h, i, _q, blk_ref):
            c = blk_ref[(b_ * kh + h) * pairs + i]
            return (b_, h, jnp.minimum(c, last), 0)

        return index

    kv_in = key_block(nb - 1)  # the dummy block of unused pairs reads a real block (masked)
    kv_out = key_block(nb)  # ... and accumulates into the extra, discarded block nb
    call = pl.pallas_call(
        functools.partial(_dkdv_kernel, **_statics(g)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kh, pairs),
            in_specs=[
                pl.BlockSpec((None, None, None, gsz, hd), row),
                pl.BlockSpec((None, None, bs, hd), kv_in),
                pl.BlockSpec((None, None, bs, vd), kv_in),
                pl.BlockSpec((None, None, None, gsz, vd), row),
                pl.BlockSpec((None, None, None, gsz, 1), lse_row),
                pl.BlockSpec((None, None, None, gsz, 1), lse_row),
                pl.BlockSpec((None, None, bs, hd), kv_out),
                pl.BlockSpec((None, None, bs, vd), kv_out),
            ],
            out_specs=[pl.BlockSpec((None, None, bs, hd), kv_out), pl.BlockSpec((None, None, bs, vd), kv_out)],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((b, kh, (nb + 1) * bs, hd), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, (nb + 1) * bs, vd), jnp.float32),
        ],
        input_output_aliases={8: 0, 9: 1},  # operands count the two prefetch arrays
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=_interpret(interpret),
        name="nsa_select_dkdv_tpu",
    )

    def chunk(carry, pair_chunk):
        dk, dv = carry
        q_c, blk_c = pair_chunk
        return tuple(call(q_c.reshape(-1), blk_c.reshape(-1), qg, k, v, do, lse, delta, dk, dv)), None

    init = (
        jnp.zeros((b, kh, (nb + 1) * bs, hd), jnp.float32),
        jnp.zeros((b, kh, (nb + 1) * bs, vd), jnp.float32),
    )
    (dk, dv), _ = jax.lax.scan(chunk, init, (split(query), split(block)))
    return dk[:, :, : nb * bs], dv[:, :, : nb * bs]


def _layout(q, k, v, block_idx, g: Geometry):
    """q[B,T,N,H] -> [B,K,T,G,H]; k,v -> [B,K,P*bs,H|V]; block_idx -> clean [B,K,T,J]."""
    b, t, _, h = q.shape
    kh = k.shape[2]
    qg = jnp.transpose(q.reshape(b, t, kh, g.groups, h), (0, 2, 1, 3, 4))
    kt = jnp.transpose(pad_axis(k, 1, g.block_size), (0, 2, 1, 3))
    vt = jnp.transpose(pad_axis(v, 1, g.block_size), (0, 2, 1, 3))
    idx = clean_block_idx(block_idx, block_size=g.block_size, s_len=g.s_len, causal=g.causal)
    return qg, kt, vt, jnp.transpose(idx, (0, 2, 1, 3))


def _from_rows(x, q_shape):
    """[B,K,T,G,*] -> [B,T,N,*]."""
    b, t, n, _ = q_shape
    return jnp.transpose(x, (0, 2, 1, 3, 4)).reshape(b, t, n, -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _select(q, k, v, block_idx, g: Geometry, interpret):
    return _select_fwd(q, k, v, block_idx, g, interpret)[0]


def _select_fwd(q, k, v, block_idx, g, interpret):
    qg, kt, vt, idx = _layout(q, k, v, block_idx, g)
    o, lse = _forward(qg, kt, vt, idx, g, interpret)
    return _from_rows(o, q.shape), (q, k, v, block_idx, o, lse)


def _select_bwd(g, interpret, res, dout):
    q, k, v, block_idx, o, lse = res
    qg, kt, vt, idx = _layout(q, k, v, block_idx, g)
    b, t, _, _ = q.shape
    kh = k.shape[2]
    do = jnp.transpose(dout.reshape(b, t, kh, g.groups, -1), (0, 2, 1, 3, 4))
    delta = jnp.einsum("bktgv,bktgv->bktg", o.astype(jnp.float32), do.astype(jnp.float32))[..., None]
    dq = _dq(qg, kt, vt, idx, do, lse, delta, g, interpret)
    dk, dv = _dkdv(qg, kt, vt, idx, do, lse, delta, g, interpret)
    dk = jnp.transpose(dk[:, :, : k.shape[1]], (0, 2, 1, 3)).astype(k.dtype)
    dv = jnp.transpose(dv[:, :, : v.shape[1]], (0, 2, 1, 3)).astype(v.dtype)
    return _from_rows(dq, q.shape).astype(q.dtype), dk, dv, None


_select.defvjp(_select_fwd, _select_bwd)


def select_attention_tpu(
    q, k, v, block_idx, *, block_size, causal=True, scale=None, interpret=False, block_sizes=BlockSizes()
):
    """TPU-style selected-block attention; same contract as select_attention_reference."""
    g = Geometry.of(q, k, block_size=block_size, causal=causal, scale=scale, block_sizes=block_sizes)
    return _select(q, k, v, block_idx, g, interpret)
