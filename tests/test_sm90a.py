"""Where the sm_90a kernels' NVRTC finds its headers (kernels/cuda/sm90a.py): MLX's own order,
so a machine where MLX's JIT finds the CUDA headers finds them for these kernels too."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from slotserve.kernels.cuda import sm90a


def _mlx_tree(root: Path, *, pip_runtime: bool) -> types.SimpleNamespace:
    """A site-packages with mlx (its bundled CCCL) and, if asked, the pip CUDA runtime."""
    (root / "mlx" / "include" / "cccl").mkdir(parents=True)
    if pip_runtime:
        (root / "nvidia" / "cuda_runtime" / "include").mkdir(parents=True)
    return types.SimpleNamespace(__file__=str(root / "mlx" / "core.so"))


def test_the_pip_cuda_runtime_headers_come_before_the_toolkits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sm90a, "mx", _mlx_tree(tmp_path, pip_runtime=True))
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda")
    assert sm90a._include_paths() == [str(tmp_path / "mlx" / "include" / "cccl"),
                                      str(tmp_path / "nvidia" / "cuda_runtime" / "include")]


def test_without_them_the_toolkit_of_cuda_home(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sm90a, "mx", _mlx_tree(tmp_path, pip_runtime=False))
    monkeypatch.setenv("CUDA_HOME", "/opt/cuda")
    assert sm90a._include_paths() == [str(tmp_path / "mlx" / "include" / "cccl"),
                                      "/opt/cuda/include"]
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert sm90a._include_paths()[-1] == "/usr/local/cuda/include"
