"""Launch shapes of slotserve's CUDA kernels: every choice of how a launch is cut, in one place.

A launch shape only decides which block computes what. Every output element is computed
the same way, in the same order, whatever the shape, so no choice here changes a bit (the
GPU tests compare launches on each side of every rule). The one exception is the 4-bit
matmul's K split, which sets the summation order: it is a function of K alone, so a row is
summed the same way in every launch.

The rules, and what decided them (measured on the H200; "under Nsight Compute" means GPU
time per kernel with the caches flushed before each, as a step reads its weights from HBM):

* q4_matmul, K split (`k_split`): 8 warps where K allows. 4 looked faster timing one weight
  matrix that stayed in the 50 MB L2; through the model (every weight read from HBM once a
  step) 8 gave 187 decode tok/s at one stream against 127.
* q4_matmul, row tiles x column tiles x ring stages (`Q4_SHAPES`): each shape's time under
  Nsight Compute on the Llama-3-8B weight shapes (bench/gpu_profile.py --launches sweeps
  them); the numbers are beside each row of the table.
* q4_matmul, the RMS norm in the launch's prologue for launches of one row tile and up to
  `NORM_ROWS` rows, else the `rms_rows` kernel first. Every block of the launch normalizes
  all its rows (12.0 -> 13.6 µs for the QKV launch at one row), but a launch per norm goes:
  a 1-row decode step 3,529 -> 3,333 µs under Nsight Compute, 235 -> 170 kernels.
* q4_matmul, SwiGLU in the epilogue of every launch: under the per-group float32 rule
  before 2026-12-07 it cost a block of two row tiles 130 registers instead of 128 (nvcc
  13, sm_90a), half its occupancy, so those launches ran the `swiglu` kernel after them;
  the bf16(s*q+b) rule keeps that block at 114 with the epilogue (bench/cuda_registers.py).
  H100, one decode step under Nsight Compute: 64 rows 9,846 -> 9,594 µs (-2.5 %).
* q4_gemm (`q4_gemm`): launches of `GEMM_ROWS` rows or more whose columns fill
  `GEMM_BLOCKS` blocks of 128 x 128 run q4_gemm instead of q4_matmul's tiles (the same
  bits). Llama-3-8B shape, one engine on an H100 prefilling cold prompts in 1,024-token
  steps, the two in turn: 1k prompt 119-121 -> 113 ms, 4k 477-478 -> 444 ms, 16k
  2,300-2,334 -> 2,119-2,145 ms. Below GEMM_BLOCKS it loses (a micro-benchmark: 200 rows
  of O, 64 blocks, 91 -> 119 µs). On Hopper it is q4_wgmma (the same bits): H100,
  `bench/gpu.sh kernel_ab`, 1,024 rows, two rounds each, q4_gemm -> q4_wgmma: gate+up
  1.59-1.67 -> 1.46 ms, down 0.75 -> 0.68-0.69, QKV 0.386 -> 0.376-0.394, O 0.265 ->
  0.244; 512 rows likewise except O (0.144-0.154 -> 0.144-0.165). Since 2026-12-07 (x
  into registers, the bf16(s*q+b) rule) q4_wgmma takes 0.79 ms for gate+up at 1,024 rows.
* q4_matmul, the residual add in the epilogue of every launch: no register cost (128 then), one
  launch and graph op fewer per projection (64 a step); engine sweeps with and without it
  were within noise of each other.
* paged_attention, a block per tile part (the tile's rows of one slot, up to 64 mma rows of
  query heads) and kv head: each key block is staged in shared memory once for the tile's
  rows. Prefill tiles are `ATTENTION_TILE` consecutive rows of a prompt (Batch builds them),
  decode rows a tile each; a row's bits are the same in any tile (paged_attention.cu).
* rope_attention, RoPE and the K/V write inside the attention launch where each slot has one
  row (a decode step: the block holding a row's new position, its row's or its split's,
  owns its kv head's new K/V), else `rope_write` + `paged_attention`: 267 -> 235 kernels
  in a 1-row step, the one launch 14.8 µs against 13.3 + 9.2 for the two. Split launches
  took the two-launch form until 2026-12-06; one launch fewer a layer since, measured even
  (H100, decode at a 1k context, 256 tokens, fresh engines in turn: 259.7 and 254.5 tok/s
  against 258.4 and 207.0 for the two launches).
* paged_attention, a row's keys summed in splits of `SPLIT_BLOCKS` key blocks (512 keys),
  folded in split order, whatever the launch: a row whose keys fit one split is one
  block's walk (one 16k-context row was 8 blocks on the 132 SMs); a longer one a block per
  (row, kv head, split), then folded (`attention_combine`): decode at 4k context 128 ->
  213 tok/s, at 16k 46 -> 158 tok/s (Llama-3-8B shape, 4-bit, one stream, 8 blocks a
  split). Splits of 4 blocks instead of 8 (H100, one engine run each in one call,
  2026-12-06, prefill rows split too): decode at a 1k context 246.9 -> 276.2 tok/s, at
  16k 200.8 -> 228.3; prefill at 1k 9,679 -> 9,394 tok/s, at 16k 7,677 -> 7,365, the
  partials the prefill launches wrote twice the size (rows x splits).
* paged_attention, a row's first `HEAD_SPLITS` splits of `SPLIT_BLOCKS // 2` blocks (its
  first 2,048 keys; `split_of_block`): splits of 2 blocks for every row had given a 1-row
  decode step at a 1k context 4,266 -> 3,922 µs, but at 16k 5,043 -> 5,219 µs and the 16k
  prefill's attention +7 % (H100, Nsight Compute, 2026-12-06). Short splits at the head
  alone, 2026-12-07: the 1k step 4,320.6 -> 3,907.8 µs, its attention 1,282.9 -> 866.4
  µs a step (32 layers).
* paged_attention, `attention_merge`: a prefill step's long rows folded inside one block a
  tile (MERGE: the block walks all of its rows' keys and folds each split as it leaves it)
  where the step's longest walk is no longer than its whole work spread over
  `MERGE_BLOCKS` blocks (two of the 227-register prefill blocks an SM, 132 SMs): no
  partials written and read back (2.2 GB a 1,024-row launch at 128k context with 8 blocks
  a split), each tile's queries staged once. A short chunk at a long context, or a decode
  row beside a short prompt, keeps the split launch: one block's walk over all its keys
  would be the step.
* paged_attention, `split_partials_fit`: a split launch's partials are rows x the widest
  row's splits (a launch-wide shape, as the compiled decode steps need), so one long row
  among many short ones makes them large: a 1,024-row prefill chunk beside a 128k-context
  decode row, Llama-3-8B shape, would be 4.4 GB. Above `PARTIALS_CAP` the launch folds in
  the block instead (merge; a decode step's rope then takes rope_write's launch): slower
  for that row, whose one block walks all its keys, but bounded memory (scratch of 32 KB
  a block).
* paged_attention, NARROW blocks (`attention_narrow`: mma rows that fit one warp's 16, a
  decode row's query heads): the four warps share each key block (S by keys, P V by
  dimension steps) instead of one warp doing it all; the 16k-context split launch 85.9 ->
  75.5 µs under Nsight Compute's detailed sections (still latency bound: one block of 4
  warps on most SMs, 0.8 TB/s). Since 2026-12-07 a NARROW thread holds only its warp's O
  tiles and each warp's S goes over its own staged K rows: 175 -> 130 registers and 82.4
  -> 74 KB of shared memory, three blocks an SM instead of two, so a 16k-context row's
  288 split blocks run in one wave on 132 SMs (test_cuda_registers, test_cuda_layout).
  One-stream decode, H100, fresh engines in turn (main, new, new, main): at 16k context
  210.5 / 211.0 -> 220.3 / 253.2 tok/s, at 32k 173.9 / 170.1 -> 189.8 / 196.1.
* attention_combine, a block per (row, query head): a block per (row, kv head) took its
  query heads one after another, 20.7 -> 14.0 µs a layer for one 16k-context row under
  Nsight Compute; one-stream decode steps (compiled, pipelined) at 1k context 4.32 -> 4.14
  ms, at 16k 5.26 -> 5.12 ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

NORM_ROWS = 4  # q4_matmul normalizes x in its prologue for launches of up to this many rows
GLUE_THREADS = 256  # threads a block of the elementwise kernels (rope_write, swiglu)
ATTENTION_THREADS = 128  # threads a block of the attention kernels (4 warps)
ATTENTION_TILE = 16  # rows of one prompt a paged_attention tile takes (paged_attention.cu)
SPLIT_BLOCKS = 4  # key blocks (of 128) a split of a long row's attention takes ...
HEAD_SPLITS = 8  # ... past its first splits, which take SPLIT_BLOCKS // 2 (split_of_block)
MERGE_BLOCKS = 264  # attention_merge: blocks a launch's work is spread over (2 an SM)
PARTIALS_CAP = 256 << 20  # bytes of a split launch's partials, at most (split_partials_fit)
GEMM_ROWS = 128  # q4_matmul launches of at least this many rows may run q4_gemm ...
GEMM_BLOCKS = 96  # ... where they fill at least this many of its 128 x 128 blocks
GEMM_STAGES = 2  # q4_gemm's cp.async ring (3 measured the same)
SAMPLE_THREADS = 1024  # threads a block of sample_draw (one row); sample_draw.cuh's too


@dataclass(frozen=True)
class Q4Shape:
    """One q4_matmul launch: mt row tiles of 16 and nt column tiles of 8 a block, a ring
    of `stages` chunks per warp; norm and swiglu: that work is in this launch."""

    mt: int
    nt: int
    stages: int
    norm: bool = False
    swiglu: bool = False


# (rows up to, columns from, columns below, shape): the first row that matches wins. The
# numbers: µs per launch under Nsight Compute, this shape against the best other one tried.
Q4_SHAPES: tuple[tuple[int | None, int, int | None, Q4Shape], ...] = (
    (16, 65536, None, Q4Shape(1, 8, 2)),  # the lm_head at one row: 148 vs 157
    (16, 16384, None, Q4Shape(1, 4, 2)),  # gate+up at one row: 39.7 vs 47.6
    (16, 0, None, Q4Shape(1, 2, 4)),  # QKV 11.5, O 9.0 at one row: best of 9 shapes
    (32, 0, 16384, Q4Shape(1, 4, 4)),  # narrow, up to 32 rows: down at 32 rows 41.5 vs 51.1
    # wide up to 32 rows, and every matrix above 32 rows: gate+up at 64 rows 124 vs 153
    # (4 x 2 tiles before), down 60 vs 86
    (None, 0, None, Q4Shape(2, 4, 2)),
)


def k_split(chunks: int) -> int:
    """Warps splitting K (chunks = K / 128): a function of K only, so every row count sums
    the same way (see the table above)."""
    return next(s for s in (8, 4, 2, 1) if chunks % s == 0)


def q4_shape(m: int, n: int, *, norm: bool = False, gate_up: bool = False) -> Q4Shape:
    """The launch of a q4_matmul with m rows and n columns (n % 16 == 0, q4_supported);
    norm / gate_up: whether the call asks for the RMS norm / SwiGLU, which the launch then
    does itself where the table above says."""
    shape = next(s for rows, lo, hi, s in Q4_SHAPES
                 if (rows is None or m <= rows) and n >= lo and (hi is None or n < hi))
    nt = shape.nt
    while n % (8 * nt):  # n is a multiple of 16: nt ends at 2 or more
        nt //= 2
    one_tile = shape.mt == 1
    return Q4Shape(shape.mt, nt, shape.stages, norm=norm and one_tile and m <= NORM_ROWS,
                   swiglu=gate_up)


def q4_shared_bytes(shape: Q4Shape, ksplit: int, m: int, k: int) -> int:
    """Dynamic shared memory of a q4_matmul launch: the rings or the K-split reduction
    (they share it), then with the norm in the launch the m normalized rows of x."""
    ring = ksplit * shape.stages * shape.nt * 36 * 16  # 32 weight + 4 scale uint4 a tile
    reduction = ksplit * shape.nt * 4 * 32 * 4
    return max(ring, reduction) + (m * k * 2 if shape.norm else 0)


def q4_gemm(m: int, n: int) -> bool:
    """Whether a q4_matmul of m rows and n columns runs q4_gemm (rule above; q4_gemm.cu
    takes widths that are a multiple of 128)."""
    return m >= GEMM_ROWS and n % 128 == 0 and -(-m // 128) * (n // 128) >= GEMM_BLOCKS


_GEMM_W_BYTES = 16 * 36 * 16  # a chunk of 16 column tiles' codes and scales (36 uint4 a tile)
_GEMM_STAGE_BYTES = 128 * 136 * 2 + _GEMM_W_BYTES  # a 128-row x tile and the weights
_GEMM_SUMS_BYTES = 64 * 256 * 4  # the K ranges' running sums, 64 floats a thread


def q4_gemm_shared_bytes() -> int:
    """Dynamic shared memory of a q4_gemm launch: GEMM_STAGES stages of a 128-row x tile
    (rows padded to 136) and 16 column tiles' weights and scales, then the K ranges'
    running sums (64 floats a thread)."""
    return GEMM_STAGES * _GEMM_STAGE_BYTES + _GEMM_SUMS_BYTES


def q4_wgmma_shared_bytes() -> int:
    """Dynamic shared memory of a q4_wgmma launch: a ring of 4 chunks of 16 column tiles'
    weights and scales (x goes to registers, not shared memory), two chunks' codes
    dequantized into wgmma's B layout (bf16, 32 KB each), then the running sums."""
    return 4 * _GEMM_W_BYTES + 2 * 16 * 128 * 16 + _GEMM_SUMS_BYTES


def rms_threads(k: int) -> int:
    """Threads of an rms_rows block: as q4_matmul's over K, so the two norms agree bit for
    bit (norm_row.cuh)."""
    return 32 * k_split(k // 128)


def attention_narrow(group: int, tile: int) -> bool:
    """Whether an attention block's mma rows (the GQA heads of its rows: min(64 // group,
    tile) of them) fit one warp's 16, so its four warps share each key block's work
    (paged_attention.cu's NARROW: a decode row's heads)."""
    return min(64 // group, tile) * group <= 16


def attention_shared_bytes(head_dim: int) -> int:
    """Dynamic shared memory of an attention launch: a key block's padded K rows, then its
    padded V rows (a NARROW block keeps its S in the K rows, rule above)."""
    return 2 * 128 * (head_dim // 8 + 1) * 16


def _head_split_blocks() -> int:
    """Key blocks each of a row's first HEAD_SPLITS attention splits takes: SPLIT_BLOCKS // 2,
    at least 1 (KeySplits::HALF)."""
    return max(1, SPLIT_BLOCKS // 2)


def split_of_block(block: int) -> int:
    """The attention split holding key block `block` (of 128 keys): the first HEAD_SPLITS
    splits take SPLIT_BLOCKS // 2 blocks each (at least 1), the rest SPLIT_BLOCKS
    (attention_splits.cuh's KeySplits, the kernels' rule; rule above)."""
    half = _head_split_blocks()
    head = HEAD_SPLITS * half
    return block // half if block < head else HEAD_SPLITS + (block - head) // SPLIT_BLOCKS


def split_first_block(split: int) -> int:
    """The first key block of attention split `split` (split_of_block's inverse)."""
    half = _head_split_blocks()
    return split * half if split < HEAD_SPLITS else (
        HEAD_SPLITS * half + (split - HEAD_SPLITS) * SPLIT_BLOCKS)


def split_template() -> list[tuple[str, int]]:
    """The attention kernels' template arguments of the split rule (split_of_block)."""
    return [("SPLIT_BLOCKS", SPLIT_BLOCKS), ("HEAD_SPLITS", HEAD_SPLITS)]


def attention_splits(table_blocks: int) -> int:
    """Splits of a paged_attention launch whose block tables span `table_blocks` key
    blocks: 1 (one block per row and kv head) while every row fits one split, else the
    splits of the widest table (a block per row, kv head and split, then the combine)."""
    return split_of_block(max(table_blocks, 1) - 1) + 1


def attention_tiles(segments: list[tuple[int, int]], rows: int, padded_rows: int) -> list[int]:
    """The first row of each paged_attention tile of a step: each segment's (first row,
    length) in ATTENTION_TILE pieces, then the padding rows' likewise."""
    starts = [r for row, n in segments for r in range(row, row + n, ATTENTION_TILE)]
    return starts + list(range(rows, padded_rows, ATTENTION_TILE))


def tile_walks(tiles: list[int], positions: Sequence[int], rows: int) -> list[int]:
    """The key blocks each real tile of a step walks (attention_tiles' first rows; the
    step's row positions; its real rows): its last row's position // 128 + 1, a tile's rows
    ending where the next tile's begin, ATTENTION_TILE at most (paged_attention.cu)."""
    ends = [*tiles[1:], rows]
    return [int(positions[min(end, first + ATTENTION_TILE) - 1]) // 128 + 1
            for first, end in zip(tiles, ends, strict=True) if first < rows]


def attention_merge(tile_blocks: list[int], kv_heads: int) -> bool:
    """Whether a prefill step's attention folds its long rows' splits inside one block a
    tile (paged_attention's merge) rather than a block a split: tile_blocks are the key
    blocks each tile's walk takes (tile_walks). Only where some
    row spans more than one split, and the longest walk is within the step's work over
    MERGE_BLOCKS blocks (rule above)."""
    longest = max(tile_blocks, default=0)
    spans_splits = longest > split_first_block(1)  # some row's keys span more than one split
    return spans_splits and longest * MERGE_BLOCKS <= sum(tile_blocks) * kv_heads


def split_partials_fit(rows: int, kv_heads: int, splits: int, group: int, head_dim: int
                       ) -> bool:
    """Whether a split launch's partials (float32 [rows, kv_heads, splits, group, head_dim +
    2]) stay within PARTIALS_CAP; else the launch folds in the block (rule above)."""
    return rows * kv_heads * splits * group * (head_dim + 2) * 4 <= PARTIALS_CAP


def rope_in_attention(one_row_per_slot: bool) -> bool:
    """Whether rope_attention is one attention launch (split or not): each block holding a
    row's new position then owns its kv head's new K/V, which needs one row a slot (a
    decode step)."""
    return one_row_per_slot
