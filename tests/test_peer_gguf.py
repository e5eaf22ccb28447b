"""bench/gpu_peer.py on the CPU: the random Q4_0 GGUF it writes for llama.cpp is a valid
file (read back by gguf-py, run by slotserve's own GGUF loader and, where the llama.cpp
cache has it, by llama-batched-bench), and the ratio table pairs the two sides' numbers
the right way round. The GPU run itself is bench/gpu.sh's `peer` stage."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_peer", ROOT / "bench" / "gpu_peer.py")
assert spec is not None and spec.loader is not None
gpu_peer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_peer)

VOCAB = 49408  # SmolLM2's 49,152 tokens padded with 256 control tokens, as 128,256 is
LAYERS = 2


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer files (the ones .gputok/ carries to the device)."""
    from slotserve.tools.synth import write_smollm2_tokenizer

    out = tmp_path_factory.mktemp("tok")
    write_smollm2_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    cfg = gpu_peer.preset("tiny-llama", LAYERS)
    cfg["vocab_size"] = VOCAB
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4_0.gguf"
    gpu_peer.write_gguf(path, cfg, tokenizer_dir, seed=3)
    return path


def test_random_q4_0_blocks_are_finite_weights_of_the_intended_scale() -> None:
    import gguf

    rows, cols = 64, 512
    raw = gpu_peer.random_q4_0(np.random.default_rng(0), rows, cols)
    assert raw.shape == (rows, cols // 32 * 18) and raw.dtype == np.uint8
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0)
    assert w.shape == (rows, cols) and np.isfinite(w).all()
    # w = d * (q - 8), q uniform on 0..15 (std 4.6), d about 1 / (4.6 sqrt(cols))
    assert w.std() * np.sqrt(cols) == pytest.approx(1.0, rel=0.15)
    assert len(np.unique(w)) > 1000  # random scales and nibbles, not a constant pattern
    with pytest.raises(ValueError, match="multiple of 32"):
        gpu_peer.random_q4_0(np.random.default_rng(0), 4, 48)


def test_gguf_reads_back_with_the_padded_vocabulary(tiny_gguf: Path) -> None:
    import gguf

    r = gguf.GGUFReader(tiny_gguf)
    kinds = {t.name: t.tensor_type for t in r.tensors}
    assert len(kinds) == 2 + 9 * LAYERS + 1
    q4 = gguf.GGMLQuantizationType.Q4_0
    assert all(k == q4 for n, k in kinds.items() if not n.endswith("norm.weight"))
    embd = next(t for t in r.tensors if t.name == "token_embd.weight")
    assert list(embd.shape) == [256, VOCAB]  # ggml order: (hidden, vocab)
    field = r.fields["tokenizer.ggml.tokens"]
    assert len(field.data) == VOCAB
    types = r.fields["tokenizer.ggml.token_type"]
    tail = [int(types.parts[i][0]) for i in types.data[-256:]]
    assert set(tail) == {int(gguf.TokenType.CONTROL)}
    assert int(r.fields["llama.block_count"].parts[-1][0]) == LAYERS


def test_slotserve_runs_the_gguf(tiny_gguf: Path) -> None:
    """slotserve's GGUF loader (an independent reader of llama.cpp's format) runs it."""
    import mlx.core as mx

    from slotserve.model.layers import Batch
    from slotserve.model.loader import load

    model = load(tiny_gguf, device="cpu", with_tokenizer=False, probe_rows=None).model
    ids = [1, 500, 12000, 49151]
    out = model(mx.array(ids), Batch.build([(model.new_kv(), 0, len(ids))]), [len(ids) - 1])
    logits = np.array(out.astype(mx.float32))
    assert logits.shape[-1] == VOCAB and np.isfinite(logits).all()
    assert logits.std() > 0


def _llama_batched_bench() -> Path | None:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    exe = base / "slotserve" / "llama.cpp-b11434" / "build" / "bin" / "llama-batched-bench"
    return exe if exe.exists() else None


@pytest.mark.skipif(_llama_batched_bench() is None,
                    reason="llama-batched-bench not built in ~/.cache/slotserve/llama.cpp-b11434 "
                           "(bench/peer_llamacpp.py --build-only builds it)")
def test_llama_batched_bench_runs_the_gguf(tiny_gguf: Path) -> None:
    exe = _llama_batched_bench()
    assert exe is not None
    rows = gpu_peer.batched_bench(exe, tiny_gguf, 32, 4, [1, 2], timeout=120,
                                  extra=["-t", "1"])
    assert sorted(r["pl"] for r in rows) == [1, 2]
    assert all(r["speed_tg"] > 0 and r["t"] > 0 and r["pp"] == 32 for r in rows)


def test_ratio_table_pairs_workloads_and_inverts_times() -> None:
    peer: dict[str, Any] = {
        "prompt_tokens": 128,
        "decode": [{"pp": 128, "tg": 128, "pl": 1, "speed_tg": 300.0},
                   {"pp": 128, "tg": 128, "pl": 64, "speed_tg": 5000.0}],
        "long": [{"pp": 16384, "tg": 128, "pl": 1, "speed_pp": 10000.0, "t_pp": 1.6,
                  "speed_tg": 240.0, "t": 2.2},
                 {"pp": 16384, "tg": 128, "pl": 8, "speed_pp": 9000.0, "t_pp": 14.0,
                  "speed_tg": 800.0, "t": 15.0}]}
    ours: dict[str, Any] = {
        "sampling": [{"case": "greedy", "streams": 1, "decode_tok_s": 330.0},
                     {"case": "temperature 0.7, top_p 0.9", "streams": 1,
                      "decode_tok_s": 297.0, "decode_vs_greedy": 0.9},
                     {"case": "greedy", "streams": 64, "decode_tok_s": 6000.0}],
        "long": [{"streams": 1, "context": 16384, "prefill_tok_s": 5000.0,
                  "ttft_max_ms": 3276.8, "ttft_p50_ms": 3276.8, "decode_tok_s": 120.0,
                  "wall_s": 4.5, "tokens": 128},
                 {"streams": 8, "context": 16384, "prefill_tok_s": 4000.0,
                  "ttft_max_ms": 30000.0, "ttft_p50_ms": 20000.0, "decode_tok_s": 400.0,
                  "wall_s": 30.0, "tokens": 1024}]}
    rows = {r["workload"]: r for r in gpu_peer.ratio_rows(peer, ours)}
    assert rows["decode, N=1, 128-token prompt (t/s)"]["ratio"] == 1.1
    assert rows["decode, N=64, 128-token prompt (t/s)"]["ratio"] == 1.2
    assert rows["one 16,384-token prompt: prefill (t/s)"]["ratio"] == 0.5
    assert rows["one 16,384-token prompt: decode at that context (t/s)"]["ratio"] == 0.5
    e2e = rows["8 x 16,384-token prompts + 128 new each, end to end (s)"]
    assert (e2e["llama_cpp"], e2e["slotserve"], e2e["ratio"]) == (15.0, 30.0, 0.5)
    sampled = gpu_peer.sampling_rows(peer, ours)
    assert sampled[0]["streams"] == 1 and sampled[0]["top_p vs llama.cpp"] == 0.99
    assert sampled[0]["temperature 0.7, top_p 0.9 vs greedy"] == 0.9
    # a slotserve run without --sampling: its "sampling" is the run's sampler, no table
    alone = gpu_peer.ratio_rows(peer, {"sampling": {"temperature": 0.0}, "long": ours["long"]})
    assert [r["slotserve"] for r in alone[:2]] == [None, None]
    md = gpu_peer.markdown(list(rows.values()), sampled, peer, ours)
    assert ("| 8 x 16,384-token prompts + 128 new each, end to end (s) | 15.00 | 30.00 "
            "| 0.50 |") in md


def test_contexts_read_as_slotserve_bench_reads_them() -> None:
    from slotserve.tools.bench import parse_contexts

    for text in ("1024,16384,8x16384,4x32768", " 64 , 2X128 "):
        assert gpu_peer.parse_contexts(text) == parse_contexts(text)
    for bad in ("", "8x", "ax64", "0x64", "-5"):
        with pytest.raises(ValueError):
            parse_contexts(bad)
        with pytest.raises(SystemExit):
            gpu_peer.parse_contexts(bad)
