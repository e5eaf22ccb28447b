"""The CUDA kernels' register counts where the launch rules depend on them, checked on the CPU
with nvcc on MLX's source form (bench/cuda_registers.py); skipped without CUDA 13's nvcc."""

from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from slotserve.kernels.cuda import launch

_SPEC = importlib.util.spec_from_file_location(
    "cuda_registers", Path(__file__).parent.parent / "bench" / "cuda_registers.py")
assert _SPEC is not None and _SPEC.loader is not None
cuda_registers = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cuda_registers)

pytestmark = pytest.mark.skipif(cuda_registers.nvcc_major() != 13,
                                reason="needs nvcc from CUDA 13, as MLX's CUDA wheels compile")


def _counts(launches: list[tuple[str, list[tuple[str, Any]]]], workdir: Path
            ) -> list[tuple[int, int]]:
    """cuda_registers.counts of each (kernel name, template), two nvcc runs at a time (the
    CI machine's two cores), each in a folder of its own."""
    def one(i: int) -> tuple[int, int]:
        folder = workdir / str(i)
        folder.mkdir()
        return cuda_registers.counts(*launches[i], folder)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(len(launches))))


def _unique(kernel: str, wanted: str) -> list[tuple[str, list]]:
    """The engine's launches of one kernel whose label holds `wanted`, one per template."""
    seen: dict[str, tuple[str, list]] = {}
    for label, name, template in cuda_registers.cases():
        if name == kernel and wanted in label:
            seen.setdefault(repr(template), (label, template))
    return list(seen.values())


def test_two_row_tile_q4_matmul_keeps_two_blocks_an_sm(tmp_path: Path) -> None:
    """A q4_matmul block of two row tiles is 256 threads: at 128 registers two blocks fit an
    SM's 64k, above it one, and its launch rules were measured with two (launch.py). A
    subtract-free dequantization once took it to 134 with no test failing."""
    launches = _unique("q4_matmul", "mt=2")
    assert launches, "the engine has launches of two row tiles"
    found = _counts([("q4_matmul", template) for _, template in launches], tmp_path)
    for (label, _), (used, spilled) in zip(launches, found, strict=True):
        assert used <= 128 and spilled == 0, (label, used, spilled)


def test_the_widest_kernels_do_not_spill(tmp_path: Path) -> None:
    """q4_gemm's loop holds 248 registers by design (its shapes are read opaquely so nvcc
    keeps them; 162 under the bf16(s*q+b) rule), q4_wgmma's 196 (64 of them wgmma's
    accumulators, 64 two chunks' x fragments), and the prefill attention launch 227, 235
    where it folds splits (MERGE): none may spill to local memory, and the attention
    launches keep two blocks an SM (launch.MERGE_BLOCKS counts on it: 240 registers a
    thread at most)."""
    tile = launch.ATTENTION_TILE
    widest = ("q4_gemm resid=False", "q4_wgmma resid=True", f"paged_attention tile {tile}",
              f"paged_attention tile {tile} merge")
    launches = [(label, name, t) for label, name, t in cuda_registers.cases() if label in widest]
    assert len(launches) == 4
    found = _counts([(name, template) for _, name, template in launches], tmp_path)
    for (label, name, _), (used, spilled) in zip(launches, found, strict=True):
        assert used <= 255 and spilled == 0, (name, used, spilled)
        if name == "paged_attention":
            assert used <= 240, (label, used)


def test_sample_draw_fits_a_block_of_1024_threads(tmp_path: Path) -> None:
    """sample_draw runs one block of launch.SAMPLE_THREADS (1,024) threads a row: above 64
    registers a thread the block needs more than an SM's 64k and the launch fails outright,
    on every sampled step."""
    assert launch.SAMPLE_THREADS == 1024
    ((used, spilled),) = _counts([("sample_draw", [])], tmp_path)
    assert used <= 64 and spilled == 0, (used, spilled)


def test_decode_attention_keeps_three_blocks_an_sm(tmp_path: Path) -> None:
    """A decode step's attention blocks (a tile of one row, NARROW) are 128 threads: at 168
    registers or fewer three fit an SM's 64k, as their shared memory does
    (test_cuda_layout), and a 16k-context row's 288 split blocks run in one wave on 132 SMs.
    Each thread holding every O tile, its warp's and the other three's zeros, took them to
    175."""
    launches = [(label, name, t) for label, name, t in cuda_registers.cases()
                if label.endswith("tile 1")]
    assert {name for _, name, _ in launches} >= {"rope_attention_split", "rope_attention"}
    found = _counts([(name, template) for _, name, template in launches], tmp_path)
    for (label, _, _), (used, spilled) in zip(launches, found, strict=True):
        assert used <= 168 and spilled == 0, (label, used, spilled)
