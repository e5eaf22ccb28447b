"""How the Batcher shares a tick's prefill budget between waiting prompts."""

from __future__ import annotations

from dataclasses import dataclass, field

from slotserve.actors.batcher import Batcher


@dataclass
class Row:
    tokens: list[int]


@dataclass
class Waiting:
    """The parts of a slot's offer (messages.Ready) the prefill share reads."""

    slot_id: int
    arrived_at: float
    pending: list[int] = field(default_factory=list)

    @property
    def id(self) -> int:
        return self.slot_id

    @property
    def work(self) -> Row:
        return Row(self.pending)


def _share(slots: list[Waiting], budget: int) -> dict[int, int]:
    return {s.slot_id: take
            for s, take in Batcher._share_prefill(slots, budget)}  # type: ignore[arg-type]


def test_short_prompt_is_not_held_behind_a_long_one() -> None:
    long_doc = Waiting(1, 0.0, [0] * 2000)
    chat = Waiting(2, 1.0, [0] * 40)
    assert _share([long_doc, chat], 256) == {1: 216, 2: 40}


def test_oldest_always_gets_half_the_budget() -> None:
    oldest = Waiting(1, 0.0, [0] * 2000)
    others = [Waiting(i, float(i), [0] * 100) for i in range(2, 6)]
    shares = _share([oldest, *others], 256)
    assert shares[1] == 128
    assert sum(shares.values()) == 256
    assert shares[2] == 100 and shares[3] == 28 and shares[4] == 0 and shares[5] == 0


def test_budget_never_exceeded_and_nothing_lost() -> None:
    slots = [Waiting(i, float(i), [0] * n) for i, n in enumerate([5, 300, 1, 64])]
    shares = _share(slots, 256)
    assert sum(shares.values()) <= 256
    assert all(0 <= shares[s.id] <= len(s.pending) for s in slots)
    assert _share([Waiting(9, 0.0, [0] * 3)], 256) == {9: 3}


def test_prompts_of_one_length_go_one_after_another() -> None:
    """Eight 16k prompts at once: the oldest takes the whole budget (its remainder is the
    shortest), so the first answer starts after one prompt's prefill, not two at half
    speed; the next one in line follows."""
    slots = [Waiting(i, float(i), [0] * 16384) for i in range(8)]
    assert _share(slots, 1024) == {0: 1024, **{i: 0 for i in range(1, 8)}}
    slots[0].pending = [0] * 300  # the oldest's last chunk: the next prompt takes the rest
    assert _share(slots, 1024) == {0: 300, 1: 724, **{i: 0 for i in range(2, 8)}}
