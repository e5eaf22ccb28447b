"""The MLX attention path (GPU, and CPU without the native kernel) against plain softmax
attention, reading the paged pool in place, on the CPU and (marked gpu) the GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from slotserve.kernels.attention import (
    AttentionPlan,
    decode_attention,
    paged_blocks,
    reference_attention,
    segment_attention,
)
from slotserve.kernels.invariance import attention_invariant

DEVICES = [
    pytest.param(mx.cpu, id="cpu"),
    pytest.param(mx.gpu, id="gpu", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not mx.is_available(mx.gpu), reason="no GPU"),
    ]),
]


def _engine_dtype(device: mx.Device) -> tuple[mx.Dtype, float]:
    """What the engine computes in on this device, and the tolerance against float32."""
    return (mx.float32, 3e-5) if device == mx.cpu else (mx.bfloat16, 3e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_and_prefill_match_reference(device: mx.Device) -> None:
    dtype, atol = _engine_dtype(device)
    with mx.stream(device):
        hkv, group, d, cap = 2, 3, 64, 384
        caches_k = [mx.random.normal((hkv, cap, d), key=mx.random.key(i)) for i in range(3)]
        caches_v = [mx.random.normal((hkv, cap, d), key=mx.random.key(10 + i)) for i in range(3)]
        q = mx.random.normal((cap, hkv * group, d), key=mx.random.key(20))
        caches_k = [c.astype(dtype) for c in caches_k]
        caches_v = [c.astype(dtype) for c in caches_v]
        q = q.astype(dtype)
        keys, idx = paged_blocks(caches_k)
        values, _ = paged_blocks(caches_v)
        scale = d**-0.5
        positions = [5, 200, 383]
        plans = [AttentionPlan.build(p, 1) for p in positions]
        span = max(p.span for p in plans)
        bias = mx.concatenate([mx.pad(p.bias(None), [(0, 0), (0, span - p.span)],
                                      constant_values=-mx.inf) for p in plans])
        qs = mx.stack([q[p] for p in positions])
        got = decode_attention(qs, keys, values, idx[:, : span // 128], bias, scale)
        for i, p in enumerate(positions):
            want = reference_attention(q[p : p + 1], caches_k[i], caches_v[i], p, scale)
            np.testing.assert_allclose(np.asarray(got[i].astype(mx.float32)),
                                       np.asarray(want[0]), atol=atol)
        plan = AttentionPlan.build(100, 150)
        chunk = segment_attention(q[100:250], keys, values, idx[1:2], plan, scale, 64)
        want = reference_attention(q[100:250], caches_k[1], caches_v[1], 100, scale, 64)
        np.testing.assert_allclose(np.asarray(chunk.astype(mx.float32)), np.asarray(want),
                                   atol=atol)


@pytest.mark.gpu
@pytest.mark.skipif(not mx.is_available(mx.gpu), reason="no GPU")
def test_mlx_path_is_batch_invariant_on_the_gpu() -> None:
    with mx.stream(mx.gpu):
        assert attention_invariant(3, 3, 64, mx.bfloat16)


# Without the native kernels (SLOTSERVE_NATIVE=0) a CPU engine runs on MLX ops over the BLAS.
_FALLBACK_ENGINE = """
import anyio
from slotserve.engine import BatchVarianceError, Engine

async def main():
    try:
        async with Engine.load(max_slots=2) as engine:
            done = await engine.complete("The sky is", max_tokens=2, temperature=0)
            print("SERVED", len(done.token_ids))
    except BatchVarianceError as exc:
        print("REFUSED", exc)

anyio.run(main)
"""


@pytest.mark.timeout(300)
def test_mlx_path_on_the_cpu_is_invariant_or_refused() -> None:
    """The MLX-ops attention is batch-invariant only where the BLAS rounds a row the same
    for every row count (OpenBLAS's AVX-512 kernels do, its AVX2 ones do not). Where it is
    not, the engine's start-up probe must catch it and the engine refuse to start; where it
    is, the engine serves."""
    with mx.stream(mx.cpu):
        holds = attention_invariant(3, 3, 64, mx.float32)
    env = {**os.environ, "SLOTSERVE_NATIVE": "0"}
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_ENGINE], env=env, text=True,
                          capture_output=True, timeout=280)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()[-1]  # after the engine's log lines
    if not holds:
        assert out.startswith("REFUSED") and "attention" in out, out
    else:
        assert out.startswith(("SERVED 2", "REFUSED")), out
        if out.startswith("REFUSED"):  # the probe may only refuse for the matmuls then
            assert "linear" in out and "attention" not in out, out
