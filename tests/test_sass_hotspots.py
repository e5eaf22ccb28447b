"""bench/sass_hotspots.py's reading of Nsight Compute's per-instruction SASS page (runs on
the CPU: the rows are ncu's, copied from a real run on an H100 of the prefill attention
kernel before its fold read scratch at once, trimmed to seven instructions and the columns
the tool reads)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "sass_hotspots", Path(__file__).parent.parent / "bench" / "sass_hotspots.py")
assert _SPEC is not None and _SPEC.loader is not None
sass_hotspots = importlib.util.module_from_spec(_SPEC)
sys.modules["sass_hotspots"] = sass_hotspots  # its dataclasses look their module up
_SPEC.loader.exec_module(sass_hotspots)

_KERNEL = ('"Kernel Name","mlx::core::cu::custom_kernel_slotserve_paged_attention_bfloat16_t_'
           '4_128_0_16_4_f_t_69632(const __nv_bfloat16 *, const __nv_bfloat16 *)",')
_COLUMNS = ["Address", "Source", "Warp Stall Sampling (All Samples)",
            "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
            "stall_barrier", "stall_dispatch", "stall_long_sb", "stall_math",
            "stall_not_selected", "stall_selected", "stall_short_sb", "stall_wait",
            "stall_long_sb (Not Issued)"]
_ROWS = [
    ["0x7f46077c2b60", "@!P0  BRA 0x7f46077c4b20", "2848", "2085", "254976",
     "2733", "0", "0", "0", "10", "16", "0", "89", "0"],
    ["0x7f46077ca5c0", "      HMMA.16816.F32.BF16 R64, R148, R40, R64", "842", "661",
     "254976", "0", "1", "0", "6", "6", "14", "741", "74", "0"],
    ["0x7f46077ca6b0", "      HMMA.16816.F32.BF16 R48, R148, R108, R48", "626", "489",
     "254976", "0", "0", "0", "9", "5", "21", "528", "63", "0"],
    ["0x7f46077c5320", "      FMUL R31, R218, R178", "597", "484", "254976",
     "0", "0", "570", "0", "5", "22", "0", "0", "470"],
    ["0x7f46077cca60", "      FMUL R18, R18, R15", "590", "406", "60,416",
     "0", "0", "586", "0", "1", "1", "0", "2", "400"],
    ["0x7f46077ccbe0", "      FMUL R17, R18, R15", "585", "412", "60,416",
     "0", "0", "575", "0", "2", "5", "0", "3", "405"],
    ["0x7f46077cccf0", "      FMUL R17, R18, R15", "606", "433", "60,416",
     "0", "0", "594", "0", "6", "3", "0", "3", "425"],
]


def _csv(path: Path) -> Path:
    def line(cells: list[str]) -> str:
        return ",".join(f'"{c}"' for c in cells)

    path.write_text("\n".join([
        "==PROF== Connected to process 1035 (/usr/bin/python3.12)",
        '{"ctx": 16384, "chunk": 1024, "merge": true, "ms": 2.284, "same_bits": true}',
        "==PROF== Disconnected from process 1035",
        _KERNEL, line(_COLUMNS), *(line(r) for r in _ROWS)]) + "\n")
    return path


def test_reads_instructions_and_issued_stall_reasons(tmp_path: Path) -> None:
    [kernel] = sass_hotspots.read(_csv(tmp_path / "k.csv"))
    assert "paged_attention" in kernel.name
    assert len(kernel.instructions) == 7
    assert kernel.samples == 2848 + 842 + 626 + 597 + 590 + 585 + 606
    bra, hmma = kernel.instructions[0], kernel.instructions[1]
    assert bra.opcode == "BRA" and bra.stalls["barrier"] == 2733
    assert hmma.opcode == "HMMA.16816.F32.BF16" and hmma.executed == 254976
    fold = kernel.instructions[4]
    assert fold.executed == 60416  # "60,416": ncu's thousands separators
    assert fold.stalls == {"long_sb": 586, "not_selected": 1, "selected": 1, "wait": 2}


def test_groups_by_executed_count_show_where_warps_wait(tmp_path: Path) -> None:
    [kernel] = sass_hotspots.read(_csv(tmp_path / "k.csv"))
    loop, fold = sass_hotspots.groups(kernel)
    assert (loop.executed, len(loop.instructions)) == (254976, 4)
    assert (fold.executed, len(fold.instructions)) == (60416, 3)
    assert fold.stalls().most_common(1) == [("long_sb", 586 + 575 + 594)]
    assert loop.opcodes()[0] == ("BRA", 1, 2848)
    text = sass_hotspots.report(kernel)
    assert "x    254,976      4 instructions" in text
    assert "x     60,416      3 instructions" in text
    assert "long_sb 98.5 %" in text  # the fold's samples: almost all wait on memory


def test_a_file_without_sass_rows_is_an_error(tmp_path: Path, capsys) -> None:
    empty = tmp_path / "none.csv"
    empty.write_text("==PROF== No kernels were profiled.\n")
    assert sass_hotspots.main([str(empty)]) == 1
    assert "no SASS rows" in capsys.readouterr().err
