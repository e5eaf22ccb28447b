"""`slotserve export`: the exported HF directory loads in transformers and in slotserve
and gives the same greedy tokens as slotserve on the original GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from slotserve.model.loader import load
from slotserve.runtime.plain import greedy_tokens
from slotserve.tools.export import export

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
STEPS = 16


def greedy(lm, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    return greedy_tokens(lm.model, ids, STEPS)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export(None, tmp_path_factory.mktemp("smollm2-hf"))


def test_export_roundtrip_slotserve_and_transformers(exported: Path) -> None:
    import torch
    import transformers

    from slotserve.model.chat_template import ChatTemplate

    original = load(None, device="cpu", probe_rows=None)
    text = ChatTemplate.for_tokenizer(original.tokenizer).render(PROMPT)
    ids = original.tokenizer.encode(text, parse_special=True)
    ours = greedy(original, ids)

    again = load(exported, device="cpu", probe_rows=None)
    assert again.tokenizer.encode(text, parse_special=True) == ids
    assert greedy(again, ids) == ours

    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    assert hf_tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True) == text
    assert hf_tok(text, add_special_tokens=True)["input_ids"] == ids
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    finally:
        torch.set_num_threads(threads)
    assert gen[0, len(ids):].tolist() == ours
    assert "Paris" in original.tokenizer.decode(ours)
