"""A request's tokens are the same bits whichever instruction set the CPU kernels are built for.

The kernels keep one order of float operations per output on every target (vec.h, qgemm.c),
so the engine run with the AVX2 build (`SLOTSERVE_CPU_ARCH=x86-64-v3`) must produce exactly
the tokens of the native build (AVX-512 here) and of x86-64-v4, greedy and seeded sampling.
Each target runs in its own process (the build is chosen when the kernels are first loaded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import NATIVE_ARCHS

_ENGINE = """
import json
import anyio
from slotserve.engine import Engine
from slotserve.kernels import native

async def main():
    async with Engine.load(max_slots=2) as engine:
        msgs = [{"role": "user", "content": "Name three rivers of Europe."}]
        greedy = await engine.chat_complete(msgs, max_tokens=24, temperature=0,
                                            ignore_eos=True)
        sampled = await engine.chat_complete(msgs, max_tokens=24, temperature=0.8, top_p=0.9,
                                             seed=7, ignore_eos=True)
        built = str(native.library_path())  # the build this process runs
        print(json.dumps([greedy.token_ids, sampled.token_ids, built]))

anyio.run(main)
"""


@pytest.mark.skipif(len(NATIVE_ARCHS) < 2, reason="this CPU runs one kernel target only")
@pytest.mark.timeout(300)
def test_every_target_gives_the_same_tokens() -> None:
    outputs = {}
    for arch in NATIVE_ARCHS:
        env = {**os.environ, "SLOTSERVE_CPU_ARCH": arch}
        proc = subprocess.run([sys.executable, "-c", _ENGINE], env=env, text=True,
                              capture_output=True, timeout=140)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outputs[arch] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len({out[2] for out in outputs.values()}) == len(outputs)  # each its own build
    first = outputs[NATIVE_ARCHS[0]]
    assert len(first[0]) == 24 and len(first[1]) == 24
    for arch, out in outputs.items():
        assert out[:2] == first[:2], arch
