"""Model-level checks shared by the family tests."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from slotserve.model.layers import Batch


def assert_mixed_decode_matches_solo(model: Any, prompt: list[int], nxt: list[int]) -> None:
    """One decode call over three slots gives each row exactly its solo logits."""
    seqs = [prompt[:5], prompt[:23], prompt + prompt[:9]]
    kvs = [model.new_kv() for _ in seqs]
    for kv, s in zip(kvs, seqs, strict=True):
        model(mx.array(s), Batch.build([(kv, 0, len(s))]), [len(s) - 1])
    parts = [(kv, len(s), 1) for kv, s in zip(kvs, seqs, strict=True)]
    together = model(mx.array(nxt), Batch.build(parts), [0, 1, 2])
    for i, part in enumerate(parts):
        alone = model(mx.array(nxt[i : i + 1]), Batch.build([part]), [0])
        assert mx.array_equal(together[i], alone[0]), i


def hf_greedy(hf: Any, prompt: list[int], steps: int) -> list[int]:
    """Hugging Face `generate` greedy continuation of exactly `steps` tokens."""
    import torch

    with torch.no_grad():
        ids = hf.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=steps, min_new_tokens=steps,
        )
    return ids[0, len(prompt) :].tolist()
