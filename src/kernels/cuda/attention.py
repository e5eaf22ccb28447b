"""Paged attention (paged_attention.cu) over the KV pool, and its decode-step form that
rotates q and k and writes the new K/V in the same launch (rope_attention).

MLX's attention for a paged pool is ~15 small kernels per layer. Here one thread block
per (tile, kv head) attends the GQA query heads of a tile's rows (up to
launch.ATTENTION_TILE rows of one slot) over the slot's K/V on the tensor cores, reading
K/V blocks through the slot's block table (the pool layout of slotserve.model.kv), with an
online softmax in key blocks of 128 at fixed absolute positions. Each row's sums are its
own whatever its tile, so a position's output never depends on how it was batched.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from slotserve.kernels.cuda import launch
from slotserve.kernels.cuda.glue import rope_write
from slotserve.kernels.cuda.launch import ATTENTION_THREADS
from slotserve.kernels.cuda.sources import kernel

MAX_GROUP = 64  # query heads a kv head (a block's 64 mma rows take one row's at least)


def attention_supported(dtype: mx.Dtype, head_dim: int) -> bool:
    return dtype == mx.bfloat16 and head_dim % 16 == 0 and head_dim <= 128


def _blocks_a_tile(group: int, tile: int) -> int:
    """Blocks a tile of `tile` rows takes per kv head (and split): a block's 64 mma rows
    hold the query heads of 64 // group rows, up to a tile's (paged_attention.cu's SUB)."""
    return -(-tile // min(tile, 64 // group))


def _tiles(tiles: mx.array | None, rows: int) -> tuple[mx.array, int]:
    """A launch's tiles and their most rows: Batch's (launch.attention_tiles), or one row a
    tile."""
    if tiles is None:
        return _row_tiles(rows), 1
    return tiles, launch.ATTENTION_TILE


@cache
def _row_tiles(rows: int) -> mx.array:
    """One row a tile, made once per row count (rope_attention asks every layer)."""
    return mx.arange(rows, dtype=mx.int32)


@cache
def _attention_params(scale: float) -> mx.array:
    """The kernel's params input (scale in log2 units), made once per scale."""
    return mx.array([scale * 1.4426950408889634], dtype=mx.float32)


@cache
def _no_sinks() -> mx.array:
    """The sinks input of a launch without sinks (SINKS false: never read)."""
    return mx.zeros((1,), dtype=mx.float32)


def _sinks(sinks: mx.array | None) -> tuple[mx.array, bool]:
    """(the sinks input, SINKS): sinks [Hq] are attention-sink logits in log2 units
    (gpt-oss; Attention scales them by log2 e once), one more softmax term per query head
    that weights no value, as slotserve.kernels.attention.grouped_attention adds it."""
    return (_no_sinks(), False) if sinks is None else (sinks.astype(mx.float32), True)


def paged_attention(q: mx.array, kpool: mx.array, vpool: mx.array, tables: mx.array,
                    row_table: mx.array, row_pos: mx.array, scale: float,
                    window: int | None = None, sinks: mx.array | None = None,
                    tiles: mx.array | None = None, merge: bool = False) -> mx.array:
    """q [R, Hq, D] or [R, Hq * D]; pools [blocks * 128, D]; tables [S, nb, Hkv] -> bf16
    output in q's shape (the 2-D form, as rope_write gives q, adds no reshape to the graph);
    sinks: [Hq] attention-sink logits in log2 units (see _sinks); tiles: the first row of
    each tile (launch.attention_tiles; None: a tile a row); merge: rows longer than a split
    are folded inside one block a tile instead of a block a split (launch.attention_merge).
    Tiles and merge set only which block computes what, never a bit."""
    r, d = q.shape[0], kpool.shape[-1]
    hq = q.shape[1] if q.ndim == 3 else q.shape[1] // d
    hkv = tables.shape[2]
    group = hq // hkv
    assert group <= MAX_GROUP, "query heads a kv head"
    splits = launch.attention_splits(tables.shape[1])
    tiles, tile = _tiles(tiles, r)
    blocks = tiles.shape[0] * _blocks_a_tile(group, tile) * hkv
    sink_input, has_sinks = _sinks(sinks)
    inputs = [q.reshape(r, hq * d).astype(mx.bfloat16), kpool, vpool, tables, row_table,
              row_pos, tiles, _attention_params(scale), sink_input]
    template = [("T", kpool.dtype), ("G", group), ("D", d), ("WINDOW", window or 0),
                ("TILE", tile), *launch.split_template(), ("SINKS", has_sinks)]
    shared = launch.attention_shared_bytes(d)
    if splits == 1 or merge or not launch.split_partials_fit(r, hkv, splits, group, d):
        folds = splits > 1
        # a folding block's P.V sums: D / 2 floats a thread (attention_fold_scratch.cu)
        scratch = blocks * (d // 2) * ATTENTION_THREADS if folds else 1
        out, _ = kernel("paged_attention", shared)(
            inputs=inputs, template=[*template, ("MERGE", folds)],
            grid=(blocks * ATTENTION_THREADS, 1, 1), threadgroup=(ATTENTION_THREADS, 1, 1),
            output_shapes=[(r, hq * d), (scratch,)],
            output_dtypes=[mx.bfloat16, mx.float32])
        return out.reshape(q.shape)
    (part,) = kernel("paged_attention_split", shared)(
        inputs=inputs, template=[*template, ("MERGE", False)],
        grid=(blocks * splits * ATTENTION_THREADS, 1, 1),
        threadgroup=(ATTENTION_THREADS, 1, 1),
        output_shapes=[(r, hkv, splits, hq // hkv, d + 2)], output_dtypes=[mx.float32])
    return _combine(part, row_table, row_pos, sink_input, has_sinks, group, d).reshape(q.shape)


def _combine(part: mx.array, row_table: mx.array, row_pos: mx.array, sink_input: mx.array,
             has_sinks: bool, group: int, d: int) -> mx.array:
    """A split launch's partials [R, Hkv, splits, group, D + 2] folded into the output rows
    [R, Hq * D] (attention_combine.cu)."""
    r, hq = part.shape[0], part.shape[1] * group
    (out,) = kernel("attention_combine")(
        inputs=[part, row_table, row_pos, sink_input],
        template=[("G", group), ("D", d), *launch.split_template(),
                  ("SINKS", has_sinks)],
        grid=(r * hq * ATTENTION_THREADS, 1, 1), threadgroup=(ATTENTION_THREADS, 1, 1),
        output_shapes=[(r, hq * d)], output_dtypes=[mx.bfloat16])
    return out


def rope_attention(qkv: mx.array, cos: mx.array, sin: mx.array, write_rows: mx.array,
                   kpool: mx.array, vpool: mx.array, tables: mx.array, row_table: mx.array,
                   row_pos: mx.array, scale: float, heads: int, kv_heads: int, head_dim: int,
                   one_row_per_slot: bool, window: int | None = None,
                   sinks: mx.array | None = None, tiles: mx.array | None = None,
                   merge: bool = False) -> mx.array:
    """paged_attention(rope_write(qkv, ...), ...): attention [R, heads * D] of fused QKV rows,
    their K/V written into the pool in place (see rope_write; row_pos are the rows'
    positions); sinks, tiles and merge as paged_attention's.

    Where each slot has one row (a decode step; launch.rope_in_attention) the attention
    launch does it: the block holding a row's new position (the row's, or its split's)
    owns its kv head's new K/V, so it rotates q and k itself, writes K/V and patches its
    staged copy of them; every block rotates q, and none reads another's new keys (a split
    launch's partials then combined, as paged_attention's). Otherwise, or where a split
    launch's partials would pass launch.PARTIALS_CAP, rope_write and paged_attention. The
    same bits either way (the same rotation, rounded to bf16 as rope_write stores it).
    """
    r = qkv.shape[0]
    if qkv.dtype != kpool.dtype:  # a float32 model (e.g. a GGUF read as f32) on a bf16 pool
        qkv = qkv.astype(kpool.dtype)
    splits = launch.attention_splits(tables.shape[1])
    if not launch.rope_in_attention(one_row_per_slot) or not launch.split_partials_fit(
            r, kv_heads, splits, heads // kv_heads, head_dim):
        q = rope_write(qkv, cos, sin, row_pos, write_rows, kpool, vpool, heads, kv_heads,
                       head_dim)
        return paged_attention(q, kpool, vpool, tables, row_table, row_pos, scale, window,
                               sinks, tiles, merge)
    assert write_rows.shape[0] <= r and write_rows.shape[1] == kv_heads, "pool rows per row"
    group = heads // kv_heads
    assert group <= MAX_GROUP, "query heads a kv head"
    tiles, tile = _tiles(None, r)  # a decode step's rows: a tile each
    sink_input, has_sinks = _sinks(sinks)
    shared = launch.attention_shared_bytes(head_dim)
    blocks = r * _blocks_a_tile(group, tile) * kv_heads
    inputs = [qkv, kpool, vpool, tables, row_table, row_pos, tiles, _attention_params(scale),
              sink_input, cos, sin, write_rows]
    template = [("T", kpool.dtype), ("G", group), ("D", head_dim), ("WINDOW", window or 0),
                ("TILE", tile), *launch.split_template(), ("SINKS", has_sinks),
                ("MERGE", False)]
    if splits == 1:
        (out,) = kernel("rope_attention", shared)(
            inputs=inputs, template=template, grid=(blocks * ATTENTION_THREADS, 1, 1),
            threadgroup=(ATTENTION_THREADS, 1, 1), output_shapes=[(r, heads * head_dim)],
            output_dtypes=[mx.bfloat16])
        return out
    (part,) = kernel("rope_attention_split", shared)(
        inputs=inputs, template=template, grid=(blocks * splits * ATTENTION_THREADS, 1, 1),
        threadgroup=(ATTENTION_THREADS, 1, 1),
        output_shapes=[(r, kv_heads, splits, group, head_dim + 2)],
        output_dtypes=[mx.float32])
    return _combine(part, row_table, row_pos, sink_input, has_sinks, group, head_dim)
