"""A new chat that opens with a prompt another conversation holds (an agent's long system
prompt) starts from that conversation's full KV pages, shared, not recomputed: the same
tokens as a cold start, and the other conversation keeps all of its KV."""

from __future__ import annotations

import random
from typing import Any

import anyio
import mlx.core as mx
import pytest
from engine_harness import EngineHarness, signal_first

from slotserve.actors.slot import common_prefix
from slotserve.kernels.attention import BLOCK
from slotserve.model.kv import KVPool, SlotKV

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
    h = EngineHarness(max_slots=2, max_queue=8, max_parked=2)
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
    assert other.usage.reused_tokens >= 2 * BLOCK and other.usage.reused_tokens % BLOCK == 0
    # both conversations are retained; the pages they share count once against the budget
    admission = engine.admission
    assert admission is not None
    kvs = [s.kv for s in admission.slots] + [p.kv for p in admission.parked]
    distinct = {page for kv in kvs for page in kv.pages}
    assert admission.retained_bytes() == len(distinct) * kvs[0].pool.page_bytes
    assert admission.retained_bytes() < sum(kv.nbytes for kv in kvs)
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
    assert out["short"].usage.reused_tokens >= 2 * BLOCK
    engine.drop_retained()
    assert _complete(two_slots, question).token_ids == out["short"].token_ids
    engine.drop_retained()
    alone = two_slots.call(lambda: engine.chat_complete(plan, max_tokens=48, temperature=0,
                                                        ignore_eos=True))
    assert alone.token_ids == out["long"].token_ids


def _pool() -> KVPool:
    return KVPool(num_layers=1, num_kv_heads=1, head_dim=8, dtype=mx.float32)


def test_shared_pages_are_freed_when_their_last_holder_lets_go() -> None:
    pool = _pool()
    a, b = SlotKV(pool), SlotKV(pool)
    a.reserve(3 * BLOCK)
    b.share_prefix(a, 2)
    assert b.pages == a.pages[:2] and b.capacity == 2 * BLOCK
    free = len(pool.free)
    a.release()
    assert len(pool.free) == free + 1  # only a's own third page
    b.release()
    assert len(pool.free) == free + 3


def test_a_slot_never_writes_into_a_page_another_holds() -> None:
    pool = _pool()
    a, b = SlotKV(pool), SlotKV(pool)
    a.reserve(3 * BLOCK)
    b.share_prefix(a, 2)
    b.reserve(2 * BLOCK + 10)  # a page of b's own after the shared two
    own = b.pages[2]
    # writing from inside the shared second page: that page and every later one is dropped,
    # and writing resumes at the start of the page (its positions are recomputed)
    assert b.writable_from(BLOCK + 5) == BLOCK
    assert b.pages == a.pages[:1] and not pool.shared(a.pages[1])
    assert own in pool.free
    # the donor writing into its own pages past the shared one is fine as it is
    assert a.writable_from(BLOCK + 5) == BLOCK + 5 and len(a.pages) == 3
    # but it too must not write into the page b still holds
    assert a.writable_from(5) == 0 and a.pages == []
    assert b.writable_from(BLOCK) == BLOCK and len(b.pages) == 1


def test_common_prefix_matches_the_plain_definition() -> None:
    rng = random.Random(0)
    base = [rng.randrange(50_000) for _ in range(1200)]
    for k in [*range(0, 40), 255, 256, 257, 271, 272, 1023, 1199, 1200]:
        other = [*base[:k], -1, *base[k + 1 :]]
        assert common_prefix(base, other) == k
        assert common_prefix(base[:k], base) == common_prefix(base, base[:k]) == k
