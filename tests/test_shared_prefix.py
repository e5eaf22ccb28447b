"""A new chat that opens with a prompt another conversation holds (an agent's long system
prompt) starts from that conversation's KV: its full pages shared, the start of the page
where the two part ways copied, nothing recomputed; the same tokens as a cold start, and
the other conversation keeps all of its KV."""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest
from engine_harness import EngineHarness, signal_first

from slotserve.actors.kv_cache import common_prefix
from slotserve.kernels.attention import BLOCK

SYSTEM = (
    "You are a careful coding agent working in a large repository. Before you change a "
    "file you read it, you run the tests after every change, and you explain each step in "
    "one short sentence. You never invent an API: you search for it first. You keep "
    "functions small, names clear and comments short. When a test fails you read the "
    "whole error before you touch the code, and you fix the cause, not the symptom. "
) * 3


def _chat(user: str, history: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, *(history or []),
            {"role": "user", "content": user}]


@pytest.fixture(scope="module")
def two_slots() -> Any:
    h = EngineHarness(max_slots=2, max_queue=8)
    yield h
    h.close()


def _complete(h: EngineHarness, messages: list[dict[str, str]], tokens: int = 12) -> Any:
    return h.call(lambda: h.engine.chat_complete(messages, max_tokens=tokens, temperature=0))


def test_a_new_chat_shares_the_system_prompts_pages(two_slots: EngineHarness) -> None:
    engine = two_slots.engine
    assert len(engine.render_chat(_chat("x"))) > 2 * BLOCK
    engine.drop_retained()
    first = _complete(two_slots, _chat("Rename the helper in utils.py."))
    other = _complete(two_slots, _chat("Why does the build fail on Windows?"))
    # the whole common start: full pages shared, the page where the two part ways copied
    shared = common_prefix(engine.render_chat(_chat("Rename the helper in utils.py.")),
                           engine.render_chat(_chat("Why does the build fail on Windows?")))
    assert shared % BLOCK and other.usage.reused_tokens == shared >= 2 * BLOCK
    # both conversations stay in the cache; the pages they share are resident once
    admission = engine.admission
    assert admission is not None
    cache = admission.cache
    each = sum(-(-(len(engine.render_chat(m)) + 12) // BLOCK)
               for m in (_chat("Rename the helper in utils.py."),
                         _chat("Why does the build fail on Windows?")))
    assert cache.resident == len(cache.idle) and cache.resident < each
    assert engine.kv_summary()["used"] == cache.resident * admission.page_bytes
    # the first conversation kept all of its KV: its next turn reuses it whole
    history = [{"role": "user", "content": "Rename the helper in utils.py."},
               {"role": "assistant", "content": first.text}]
    turn2 = _complete(two_slots, _chat("Now run the tests.", history))
    assert turn2.usage.reused_tokens > len(engine.render_chat(_chat("x"))) - 8
    for messages, warm in ((_chat("Why does the build fail on Windows?"), other),
                           (_chat("Now run the tests.", history), turn2)):
        engine.drop_retained()
        cold = _complete(two_slots, messages)
        assert cold.usage.reused_tokens == 0
        assert cold.token_ids == warm.token_ids and cold.text == warm.text


def test_sharing_with_a_conversation_still_generating(two_slots: EngineHarness) -> None:
    """The donor is busy: its pages in the shared prefix are final, it writes only past them."""
    engine = two_slots.engine
    engine.drop_retained()
    plan = _chat("Write a long plan for the refactor.")
    question = _chat("List ten things to check before a release.")
    out: dict[str, Any] = {}

    async def both() -> None:
        decoding = anyio.Event()

        async def short() -> None:
            await decoding.wait()
            out["short"] = await engine.chat_complete(question, max_tokens=12, temperature=0)

        request = engine.make_request(engine.render_chat(plan), max_tokens=48, temperature=0,
                                      ignore_eos=True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(short)
            out["long"] = await engine.collect(signal_first(engine.generate(request),
                                                             decoding))

    two_slots.call(both)
    # (the donor's unfinished page is not copied: whole pages only)
    assert out["short"].usage.reused_tokens == common_prefix(
        engine.render_chat(plan), engine.render_chat(question)) // BLOCK * BLOCK
    engine.drop_retained()
    assert _complete(two_slots, question).token_ids == out["short"].token_ids
    engine.drop_retained()
    alone = two_slots.call(lambda: engine.chat_complete(plan, max_tokens=48, temperature=0,
                                                        ignore_eos=True))
    assert alone.token_ids == out["long"].token_ids


def test_common_prefix_matches_the_plain_definition() -> None:
    rng = random.Random(0)
    base = [rng.randrange(50_000) for _ in range(1200)]
    for k in [*range(0, 40), 255, 256, 257, 271, 272, 1023, 1199, 1200]:
        other = [*base[:k], -1, *base[k + 1 :]]
        assert common_prefix(base, other) == k
        assert common_prefix(base[:k], base) == common_prefix(base, base[:k]) == k
