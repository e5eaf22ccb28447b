"""More conversations than slots: a conversation pushed out of its slot is parked, and its
next turn adopts the parked KV — with the same tokens as a cold prefill."""

from __future__ import annotations

from typing import Any

import pytest
from engine_harness import EngineHarness

PEOPLE = ["Ada", "Grace", "Linus"]


@pytest.fixture(scope="module")
def one_slot() -> Any:
    h = EngineHarness(max_slots=1, max_queue=4, max_parked=2)
    yield h
    h.close()


FACTS = {
    "Ada": "I write programs for the Analytical Engine and I like poetry, mathematics and "
           "long walks along the river on cold winter mornings with my old friend Charles.",
    "Grace": "I build compilers for the Navy, I keep a clock that runs backwards on my wall, "
             "and I once taped a moth into a logbook after it jammed a relay in a machine.",
    "Linus": "I started a small operating system kernel as a hobby project one summer, and "
             "now I spend my days reading patches from thousands of people around the world.",
}


def _first(name: str) -> list[dict[str, str]]:
    # the unique part is longer than what the three prompts share (template + system prompt)
    return [{"role": "user", "content": f"My name is {name}. {FACTS[name]} Remember my name."}]


def test_three_conversations_share_one_slot(one_slot: EngineHarness) -> None:
    engine = one_slot.engine
    engine.drop_retained()
    turn1 = {}
    for name in PEOPLE:  # each first turn pushes the previous conversation out of the slot
        turn1[name] = one_slot.call(
            lambda n=name: engine.chat_complete(_first(n), max_tokens=12, temperature=0))
    admission = engine.admission
    assert admission is not None and len(admission.parked) == 2

    def second(name: str) -> list[dict[str, str]]:
        return _first(name) + [{"role": "assistant", "content": turn1[name].text},
                               {"role": "user", "content": "What is my name?"}]

    warm = {}
    for name in PEOPLE:
        warm[name] = one_slot.call(
            lambda n=name: engine.chat_complete(second(n), max_tokens=12, temperature=0))
        assert warm[name].usage.reused_tokens > 20, f"{name}'s turn 2 should adopt its KV"
    for name in PEOPLE:
        engine.drop_retained()
        cold = one_slot.call(
            lambda n=name: engine.chat_complete(second(n), max_tokens=12, temperature=0))
        assert cold.usage.reused_tokens == 0
        assert cold.token_ids == warm[name].token_ids and cold.text == warm[name].text
    assert engine.drop_retained() > 0 or not admission.parked


def test_parked_kv_counts_against_the_budget_and_is_evicted_first(
        one_slot: EngineHarness) -> None:
    engine = one_slot.engine
    admission = engine.admission
    assert admission is not None
    engine.drop_retained()
    for name in PEOPLE:
        one_slot.call(lambda n=name: engine.chat_complete(_first(n), max_tokens=4,
                                                          temperature=0))
    page_bytes = admission.slots[0].kv.pool.page_bytes
    parked_bytes = len({page for p in admission.parked for page in p.kv.pages}) * page_bytes
    assert parked_bytes > 0 and admission.retained_bytes() >= parked_bytes
    # squeeze the budget: the next admission must evict parked KV (oldest first) to fit
    old_budget = admission.kv_budget
    try:
        # a short request is charged two KV growth steps; leave room for half the parked KV
        admission.kv_budget = 2 * admission.floor + parked_bytes // 2
        one_slot.call(lambda: engine.chat_complete([{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0))
        assert admission.used_bytes <= admission.kv_budget
        assert len(admission.parked) < 2
    finally:
        admission.kv_budget = old_budget
        engine.drop_retained()


def test_parked_conversations_are_capped(one_slot: EngineHarness) -> None:
    engine = one_slot.engine
    admission = engine.admission
    assert admission is not None and admission.max_parked == 2
    engine.drop_retained()
    for name in [*PEOPLE, "Ada"]:  # four first turns through one slot: three pushed out
        one_slot.call(lambda n=name: engine.chat_complete(_first(n), max_tokens=4,
                                                          temperature=0))
    assert len(admission.parked) == 2  # the oldest one was dropped
    engine.drop_retained()
