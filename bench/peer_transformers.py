"""Peer baseline: Hugging Face transformers continuous batching (`generate_batch`).

    python bench/peer_transformers.py --config /tmp/synth/llama3-8b-mlx4/config.json \
        --streams 1,64 --new-tokens 32 --out peer.json

Builds the model from a config.json (random weights, bf16, on the GPU; any
`quantization` entry is dropped: transformers runs it in bf16), sends N prompts of
random token ids at once through `generate_batch` (paged attention over sdpa,
transformers' default when flash-attention is absent), greedy, EOS disabled, and
reports aggregate tok/s over the whole call (after a warm-up call of the same N;
the call includes the manager's start-up), the decode rate between the first and
the last token of the batch (token timestamps), and the median gap between a
request's tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def build_model(config_path: str, attn: str, device: str = "cuda") -> Any:
    import torch
    import transformers

    raw = json.loads(Path(config_path).read_text())
    raw.pop("quantization", None)
    raw.pop("architectures", None)
    raw["eos_token_id"] = None
    cfg = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, attn_implementation=attn, dtype=torch.bfloat16)
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_once(model: Any, n: int, prompt_tokens: int, new_tokens: int, seed: int) -> dict[str, Any]:
    import torch
    import transformers

    g = torch.Generator().manual_seed(seed)
    vocab = min(model.config.vocab_size, 49152)
    prompts = torch.randint(0, vocab, (n, prompt_tokens), generator=g).tolist()
    gen = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
    _sync()
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen, record_timestamps=True,
                               progress_bar=False)
    _sync()
    wall = time.perf_counter() - t0
    produced = sum(len(r.generated_tokens) for r in out.values())
    gaps: list[float] = []
    firsts, lasts, after_first = [], [], 0
    for r in out.values():
        ts = r.timestamps or []
        gaps.extend(b - a for a, b in zip(ts, ts[1:], strict=False))
        if ts:
            firsts.append(ts[0])
            lasts.append(ts[-1])
            after_first += len(ts) - 1
    window = max(lasts) - min(firsts) if firsts else 0.0
    return {"streams": n, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "tokens": produced, "wall_s": round(wall, 3),
            "aggregate_tok_s": round(produced / wall, 1),
            "decode_tok_s": round(after_first / window, 1) if window > 0 else None,
            "itl_p50_ms": round(statistics.median(gaps) * 1000, 2) if gaps else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="config.json of the model shape")
    p.add_argument("--streams", default="1,64")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--attn", default="sdpa", help="transformers switches it to paged|sdpa")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch
    import transformers

    t0 = time.perf_counter()
    model = build_model(args.config, args.attn, args.device)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "build_s": round(time.perf_counter() - t0, 1),
        "params_b": round(sum(x.numel() for x in model.parameters()) / 1e9, 2),
        "attn": model.config._attn_implementation, "results": []}
    print(json.dumps({k: v for k, v in report.items() if k != "results"}), flush=True)
    for n in (int(x) for x in args.streams.split(",") if x):
        try:
            run_once(model, n, args.prompt_tokens, 4, seed=n + 1)  # warm-up (graphs, caches)
            r = run_once(model, n, args.prompt_tokens, args.new_tokens, seed=n)
        except Exception as exc:  # report and go on to the next N
            r = {"streams": n, "error": f"{type(exc).__name__}: {exc}"}
        report["results"].append(r)
        print(json.dumps(r), flush=True)
    report["attn_after"] = model.config._attn_implementation
    if torch.cuda.is_available():
        report["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
