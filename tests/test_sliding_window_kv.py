"""Sliding-window layers keep only their window resident (issue 21): Gemma 4's KV budget
charges a context per token for its global layers alone (the sliding ones are a floor of
window rows per busy slot), a sequence's window rows are recycled as it moves on, and a
conversation continued from retained state, or a branch of it, gives the tokens a cold
prefill gives. The tiny checkpoint is the engine tests' (window 16, one global layer that
writes K/V, three sliding ones, two shared), so every prompt here spans many windows and
several pages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from engine_harness import EngineHarness, preempted_like_alone
from test_gemma4_engine import make_tiny_gemma4
from tiny_models import make_tiny

from slotserve.actors.admission import pages_for
from slotserve.actors.kv_cache import KVCache
from slotserve.kernels.attention import BLOCK
from slotserve.model.kv import KVPool, SlotKV
from slotserve.model.loader import load
from slotserve.runtime.plain import greedy_tokens

NEW = 24  # tokens generated per request
GREEDY = {"temperature": 0.0, "max_tokens": NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma4(Path(tmp_path_factory.mktemp("gemma4_window")))


def long_prompt(h: EngineHarness, words: int, topic: str) -> list[int]:
    text = " ".join(f"{topic} {i}" for i in range(words))
    return h.engine.render_chat([{"role": "user", "content": text}])


def reference(checkpoint: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy tokens from the plain single-sequence loop, whose sequence
    keeps every page's window row (nothing recycled): run with no engine up (one thread
    drives MLX at a time)."""
    model = load(checkpoint, probe_rows=None).model
    return [greedy_tokens(model, p, NEW) for p in prompts]


def test_long_context_fits_where_every_layer_was_charged(checkpoint: Path) -> None:
    """A ~1k-token prompt and its answer fit a budget that charging every K/V-owning layer
    per token could not hold. There the window rows a sequence lets go of are evicted at
    once and their rows reused (the arrays hold far fewer rows than it has pages), and a
    branch of the prompt served afterwards resumes only where the rows its window needs
    are still resident. Tokens and logprobs are those of an engine whose budget keeps
    every row it let go of, and the tokens the plain loop's (no row ever recycled)."""
    def run(h: EngineHarness, prompts: list[list[int]]) -> list[Any]:
        return [h.call(lambda p=p: h.engine.complete(p, logprobs=True, **GREEDY))
                for p in prompts]

    roomy = EngineHarness(checkpoint, max_slots=1, prefill_budget=40)
    try:
        prompt = long_prompt(roomy, 420, "river")
        branch = prompt[: 5 * BLOCK + 40] + prompt[20:60]
        adm = roomy.engine.admission
        assert adm is not None
        pool = adm.cache.pool
        pages, floor = pages_for(len(prompt) + NEW), adm.floor_pages
        kept = run(roomy, [prompt, branch])
    finally:
        roomy.close()
    assert len(prompt) > 6 * BLOCK and pool.window == 16
    # every K/V-owning layer per token, as the budget charged before windows were rows
    every_layer = BLOCK * 2 * pool.dtype.size * sum(h * d for h, d in pool.shapes)
    budget = (pages + floor + 1) * pool.page_bytes
    assert pages * every_layer > budget
    tight = EngineHarness(checkpoint, max_slots=1, prefill_budget=40, kv_budget_bytes=budget)
    try:
        got = run(tight, [prompt, branch])
        windows = tight.engine.admission.cache.pool.windows  # type: ignore[union-attr]
        # rows the arrays ever held: the window's few, not one per page
        assert windows.ids < pages_for(len(prompt)) // 2
    finally:
        tight.close()
    assert kept[1].usage.reused_tokens > got[1].usage.reused_tokens  # the rows were gone
    assert got[1].usage.reused_tokens % BLOCK == 0  # a page boundary (or cold)
    for a, b in zip(kept, got, strict=True):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.token_ids == b.token_ids
        assert [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
    assert [c.token_ids for c in got] == reference(checkpoint, [prompt, branch])


@pytest.fixture(scope="module", params=["gemma4", "gemma3"])
def harness(request: pytest.FixtureRequest, checkpoint: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The engine on the gemma4 checkpoint, and on a tiny Gemma 3 (window 16, three
    sliding layers and a global one): the same window rows serve every such family."""
    path = checkpoint if request.param == "gemma4" else make_tiny(
        "gemma3", Path(tmp_path_factory.mktemp("gemma3_window")))
    h = EngineHarness(path, max_slots=2, prefill_budget=48)
    pool = h.engine.admission.cache.pool  # type: ignore[union-attr]
    assert pool.windowed and pool.window == 16
    yield h
    h.close()


def test_conversation_continued_from_retained_state_equals_cold(harness: EngineHarness) -> None:
    """Turn 1 (~5 pages, dozens of windows) finishes; turn 2 extends its prompt and answer
    and resumes past all of turn 1 from the retained rows; a branch that parts from it
    inside turn 1's prompt resumes there from rows the first sequence let go of (idle,
    kept while the budget allows). Each gives a cold prefill's tokens, greedy and
    seeded."""
    engine = harness.engine
    seeded = {**GREEDY, "temperature": 0.8, "seed": 7}
    turn1 = long_prompt(harness, 200, "mountain")
    first = harness.call(lambda: engine.complete(turn1, **GREEDY))
    turn2 = turn1 + first.token_ids + turn1[30:90]
    branch = turn1[: 3 * BLOCK + 17] + turn1[40:70]
    assert len(turn2) > 4 * BLOCK
    warm: dict[str, Any] = {}
    for name, ids, opts in (("turn2", turn2, GREEDY), ("branch", branch, seeded)):
        warm[name] = harness.call(lambda ids=ids, opts=opts: engine.complete(ids, **opts))
    assert warm["turn2"].usage.reused_tokens >= len(turn1)
    # (past the page boundary, the start of turn 1's page it shares is copied, its window
    # row with it)
    assert warm["branch"].usage.reused_tokens >= 3 * BLOCK
    for name, ids, opts in (("turn2", turn2, GREEDY), ("branch", branch, seeded)):
        engine.drop_retained()
        cold = harness.call(lambda ids=ids, opts=opts: engine.complete(ids, **opts))
        assert cold.usage.reused_tokens == 0
        assert warm[name].token_ids == cold.token_ids, name


def test_a_match_resumes_only_where_its_window_rows_are_resident() -> None:
    """The cache's rule, on its bookkeeping alone: a sequence that wrote four pages in
    steps of 64 holds the row of its last page only; the rows it let go of stay idle
    with their published pages. A lookup resumes where the rows its first query's window
    reaches are resident (here inside page 2, its start copied with its row), and is cut
    back page by page as those rows go, down to a cold start."""
    ns = ("", "")
    pool = KVPool(2, 1, 16, mx.float32, windowed=frozenset({0}), window=16)
    cache = KVCache(pool)
    tokens = list(range(4 * BLOCK))
    kv = SlotKV(pool)
    kv.managed = True
    chain = cache.take(cache.lookup(tokens, ns), kv, ns)
    kv.add_pages(cache.allocate(4, 1000))
    for pos in range(0, len(tokens), 64):  # what the Batcher and admission do each step
        kv.open_window(pos, pos + 64)
        cache.publish(kv, tokens[: pos + 64], chain)
        cache.slide(kv, pos + 64)
    pages = list(kv.pages)
    assert kv.window_pages() == pages[3:] and list(cache.idle_windows) == pages[:3]
    cache.finish(kv, tokens, chain)
    assert set(cache.idle_windows) == set(pages) and pool.windows.used == 4
    branch = tokens[: 2 * BLOCK + 44] + [-1] * 20

    def resumes() -> int:
        return cache.lookup(branch, ns).tokens

    assert resumes() == 2 * BLOCK + 44  # rows of page 2 (positions 285..299): resident
    for page, depth in ((pages[2], 2 * BLOCK), (pages[1], BLOCK)):
        del cache.idle_windows[page]
        pool.windows.detach([page])
        assert resumes() == depth
    # the cut-back match holds the rows it resumes from, and lets them go idle again
    kv2 = SlotKV(pool)
    match = cache.lookup(branch, ns)
    chain2 = cache.take(match, kv2, ns)
    assert kv2.window_pages() == [pages[0]] and pages[0] not in cache.idle_windows
    cache.finish(kv2, branch[:BLOCK], chain2)
    assert list(cache.idle_windows) == [pages[3], pages[0]]
    del cache.idle_windows[pages[0]]
    pool.windows.detach([pages[0]])
    assert resumes() == 0  # cold


def test_preempted_requests_resume_from_their_window_rows(checkpoint: Path) -> None:
    """Three gemma4 requests whose prompts fill most of two pages and whose answers cross
    into a third, on a budget that holds three busy slots' floors and two pages each: when
    they cross, the youngest steps back (its rows go idle with its pages), resumes from
    its retained pages and rows, and every one gives exactly its tokens alone."""
    h = EngineHarness(checkpoint, max_slots=3, max_queue=8, kv_reserve_tokens=0,
                      prefill_budget=48)
    try:
        engine, adm = h.engine, h.engine.admission
        assert adm is not None
        topics = ("lake", "forest", "desert")
        prompts = [long_prompt(h, 120, t)[: 2 * BLOCK - 20 + i] for i, t in enumerate(topics)]
        assert all(len(p) > BLOCK for p in prompts)
        # answers of 2 NEW tokens: all three still run when the later ones cross (the
        # prompts prefill one after another, each answer starting as its prompt is in)
        opts = [{**o, "max_tokens": 2 * NEW}
                for o in (GREEDY, {**GREEDY, "temperature": 0.8, "seed": 3}, GREEDY)]
        alone = []
        for p, o in zip(prompts, opts, strict=True):
            engine.drop_retained()
            alone.append(h.call(lambda p=p, o=o: engine.complete(p, **o)))
        engine.drop_retained()
        adm.budget_pages = 3 * (2 + adm.floor_pages) + 1

        preempted_like_alone(h, lambda i: engine.complete(prompts[i], **opts[i]), alone)
        summary = engine.kv_summary()
        assert summary["busy"] == 0 and summary["window_rows"]["held"] == 0
        assert summary["window_rows"]["floor_pages"] == adm.floor_pages
    finally:
        h.close()
