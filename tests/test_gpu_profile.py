"""bench/gpu_profile.py's reading of Nsight Compute's CSV log (runs on the CPU: the log
format is ncu's, copied from a real run on the H200, trimmed to a few kernels)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "gpu_profile", Path(__file__).parent.parent / "bench" / "gpu_profile.py")
assert _SPEC is not None and _SPEC.loader is not None
gpu_profile = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_profile)

_HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
           '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
           '"Metric Value"')


def _row(i: int, kernel: str, unit: str, value: str) -> str:
    return (f'"{i}","826","python3.12","127.0.0.1","{kernel}","1","14","(256, 1, 1)",'
            f'"(128, 1, 1)","0","9.0","Command line profiler metrics",'
            f'"gpu__time_duration.sum","{unit}","{value}"')


def test_summarize_groups_kernels_by_marked_step(tmp_path: Path) -> None:
    q4 = ("custom_kernel_slotserve_q4_matmul_1_4_8_t_f(const __nv_bfloat16 *, "
          "cuda::array<int, 10>, const unsigned int *, cuda::array<int, 10>, "
          "const unsigned int *, __nv_bfloat16 *)")
    lines = [
        "==PROF== Connected to process 826 (/usr/bin/python3.12)",
        _HEADER,
        _row(0, "void copy_s<float, float, unsigned int, 4>(const T1 *, T2 *, T3)", "ns",
             "3,872"),  # before any marker: not part of a step
        _row(1, "custom_kernel_slotserve_profile_rows1(const float *, float *)", "ns", "2,912"),
        _row(2, q4, "us", "30.5"),
        _row(3, q4, "ns", "11,100"),
        _row(4, "void rms_norm_small<__nv_bfloat16, 128, 4, 1, false>(const T1 *)", "ns",
             "4,300"),
        _row(5, "custom_kernel_slotserve_profile_rows64(const float *, float *)", "ns",
             "2,000"),
        _row(6, q4.replace("_1_4_8_", "_4_2_8_"), "ms", "0.1534"),
    ]
    log = tmp_path / "steps.csv"
    log.write_text("\n".join(lines) + "\n")
    out = gpu_profile.summarize(log)
    assert set(out) == {"1", "64"}
    assert out["1"]["kernels"] == 3
    assert out["1"]["by_kernel"]["slotserve_q4_matmul_1_4_8_t_f"] == [2, 41.6]
    assert out["1"]["by_kernel"]["rms_norm_small"] == [1, 4.3]
    assert out["1"]["total_us"] == 45.9
    assert out["64"]["by_kernel"] == {"slotserve_q4_matmul_4_2_8_t_f": [1, 153.4]}


def test_a_log_without_kernels_says_so(tmp_path: Path) -> None:
    """A profiled command that failed (an argument error, say) leaves ncu's log without
    records: summarize says so, and the command line exits 1 instead of a traceback."""
    log = tmp_path / "steps.csv"
    log.write_text("==PROF== Connected to process 826 (/usr/bin/python3.12)\n"
                   "==PROF== Disconnected from process 826\n")
    with pytest.raises(ValueError, match="no kernel records"):
        gpu_profile.summarize(log)
    assert gpu_profile.main(["--summarize", str(log)]) == 1
