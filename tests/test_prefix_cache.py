"""The one prefix cache and the KV budget (issue 26): conversations keep their KV after
their slot is gone, a next turn resumes from its last token, idle pages are evicted least
recently used first, and a request that needs a page the budget cannot give preempts the
youngest: everyone finishes with the tokens they produce alone (greedy and seeded)."""

from __future__ import annotations

from typing import Any

import anyio
import mlx.core as mx
import pytest
from engine_harness import PROMPTS, EngineHarness, preempted_like_alone

from slotserve.actors.kv_cache import Chain, KVCache
from slotserve.engine import (
    Completion,
    default_kv_budget,
    default_prefill_budget,
    gpu_cache_limit,
)
from slotserve.kernels.attention import BLOCK
from slotserve.model.kv import KVPool, SlotKV

PEOPLE = ["Ada", "Grace", "Linus"]
FACTS = {
    "Ada": "I write programs for the Analytical Engine and I like poetry, mathematics and "
           "long walks along the river on cold winter mornings with my old friend Charles.",
    "Grace": "I build compilers for the Navy, I keep a clock that runs backwards on my wall, "
             "and I once taped a moth into a logbook after it jammed a relay in a machine.",
    "Linus": "I started a small operating system kernel as a hobby project one summer, and "
             "now I spend my days reading patches from thousands of people around the world.",
}


def _first(name: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"My name is {name}. {FACTS[name]} Remember my name."}]


@pytest.fixture
def one_slot() -> Any:
    # per test, not per module: an engine left alive beside another one in the process
    # (the preemption tests below make their own) slows that one's CPU kernels about 3x
    # (two OpenMP teams on a 2-core machine: libgomp stops its workers spinning)
    h = EngineHarness(max_slots=1, max_queue=4)
    yield h
    h.close()


def test_three_conversations_through_one_slot_keep_their_kv(one_slot: EngineHarness) -> None:
    engine = one_slot.engine
    engine.drop_retained()
    turn1 = {}
    for name in PEOPLE:  # each first turn follows the previous one through the one slot
        turn1[name] = one_slot.call(
            lambda n=name: engine.chat_complete(_first(n), max_tokens=12, temperature=0))

    def second(name: str) -> list[dict[str, str]]:
        return _first(name) + [{"role": "assistant", "content": turn1[name].text},
                               {"role": "user", "content": "What is my name?"}]

    warm = {}
    for name in PEOPLE:
        warm[name] = one_slot.call(
            lambda n=name: engine.chat_complete(second(n), max_tokens=12, temperature=0))
        # the whole first turn's prompt (its last page is the conversation's tail)
        assert warm[name].usage.reused_tokens >= len(engine.render_chat(_first(name))) - 1
    for name in PEOPLE:
        engine.drop_retained()
        cold = one_slot.call(
            lambda n=name: engine.chat_complete(second(n), max_tokens=12, temperature=0))
        assert cold.usage.reused_tokens == 0
        assert cold.token_ids == warm[name].token_ids and cold.text == warm[name].text


def test_idle_pages_count_and_are_evicted_least_recently_used(one_slot: EngineHarness) -> None:
    engine = one_slot.engine
    admission = engine.admission
    assert admission is not None
    engine.drop_retained()
    for name in PEOPLE:
        one_slot.call(lambda n=name: engine.chat_complete(_first(n), max_tokens=4,
                                                          temperature=0))
    cache = admission.cache
    idle = len(cache.idle)
    assert idle >= 3 and cache.resident == idle and cache.held == 0
    newest = next(reversed(cache.idle))
    old_budget = admission.budget_pages
    try:  # room for one request: a prompt page and its reserve (promised, not yet taken)
        admission.budget_pages = 1 + admission.reserve_pages
        one_slot.call(lambda: engine.chat_complete([{"role": "user", "content": "Hi"}],
                                                   max_tokens=4, temperature=0))
        assert cache.resident <= admission.budget_pages
        # least recently used first: the newest idle page is still there
        assert cache.evictions["budget"] >= 1 and newest in cache.idle
        assert engine.kv_summary()["evictions"]["budget"] == cache.evictions["budget"]
    finally:
        admission.budget_pages = old_budget
        engine.drop_retained()


# enough to carry each of the six prompts (31-43 tokens rendered) into its second page
PREEMPT_TOKENS = 112


def _options(i: int) -> dict[str, Any]:
    if i % 2:
        return {"temperature": 0.8, "seed": 40 + i, "max_tokens": PREEMPT_TOKENS,
                "ignore_eos": True}
    return {"temperature": 0.0, "max_tokens": PREEMPT_TOKENS, "ignore_eos": True}


def test_preempted_requests_resume_with_their_own_tokens() -> None:
    """Six requests that each end on a second page, a budget of six pages and no reserve:
    when they cross into their second page, the youngest step back, resume later, and
    every one finishes with exactly the tokens it produces alone."""
    h = EngineHarness(max_slots=6, max_queue=8, kv_reserve_tokens=0)
    try:
        engine = h.engine
        adm = engine.admission
        assert adm is not None
        prompts = [[{"role": "user", "content": p}] for p in PROMPTS[:6]]
        assert all(BLOCK < len(engine.render_chat(p)) + PREEMPT_TOKENS <= 2 * BLOCK
                   for p in prompts)
        alone = []
        for i, p in enumerate(prompts):
            engine.drop_retained()
            alone.append(h.call(lambda p=p, i=i: engine.chat_complete(p, **_options(i))))
        engine.drop_retained()
        adm.budget_pages = 6

        preempted_like_alone(h, lambda i: engine.chat_complete(prompts[i], **_options(i)), alone)
        assert engine.kv_summary()["busy"] == 0
    finally:
        h.close()


def test_requests_without_max_tokens_all_complete_on_a_small_budget() -> None:
    """SmolLM2 with 64 MiB of KV (eleven pages): eight requests that leave max_tokens out
    (each may run to the context) are admitted as pages allow and all finish."""
    h = EngineHarness(max_slots=8, max_queue=16, kv_budget_bytes=64 * 2**20)
    try:
        engine = h.engine
        questions = [[{"role": "user", "content": p}] for p in PROMPTS]

        async def run() -> list[Completion]:
            return list(await _gather([engine.chat_complete(q, temperature=0)
                                       for q in questions]))

        out = h.call(run)
        for c in out:
            assert c.finish_reason in ("stop", "length") and c.error is None, c
        for q, c in zip(questions, out, strict=True):
            engine.drop_retained()
            alone = h.call(lambda q=q: engine.chat_complete(q, temperature=0))
            assert alone.token_ids == c.token_ids
        assert engine.kv_summary()["pages"]["budget"] == 64 * 2**20 // engine.kv_summary()[
            "page_bytes"]
    finally:
        h.close()


async def _gather(coros: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(coros)

    async def one(i: int) -> None:
        out[i] = await coros[i]

    async with anyio.create_task_group() as tg:
        for i in range(len(coros)):
            tg.start_soon(one, i)
    return out


# ---- the cache itself ----------------------------------------------------------------

def _cache() -> tuple[KVPool, KVCache]:
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=8, dtype=mx.float32)
    return pool, KVCache(pool)


def _run(cache: KVCache, tokens: list[int],
         ns: tuple[str, str] = ("", "")) -> tuple[SlotKV, Chain]:
    """A sequence that wrote `tokens` (its pages taken as the cache would hand them out)."""
    kv = SlotKV(cache.pool)
    match = cache.lookup(tokens, ns)
    chain = cache.take(match, kv, ns)
    kv.add_pages(cache.allocate(-(-len(tokens) // BLOCK) - len(kv.pages), 1000))
    cache.publish(kv, tokens, chain)
    return kv, chain


def test_full_pages_are_shared_by_exact_prefix_and_namespace() -> None:
    _, cache = _cache()
    a_tokens = list(range(3 * BLOCK + 10))
    a, _ = _run(cache, a_tokens)
    same = cache.lookup(a_tokens[: 2 * BLOCK] + [-1] * 50, ("", ""))
    assert same.pages == a.pages[:2] and same.tokens == 2 * BLOCK
    assert cache.lookup(a_tokens, ("other", "")).tokens == 0  # another namespace
    assert cache.lookup(a_tokens, None).tokens == 0
    changed = [7, *a_tokens[1:]]  # the first token differs: no page matches
    assert cache.lookup(changed, ("", "")).tokens == 0
    # the whole prompt cached: the last token is still fed (its page's start is copied)
    whole = cache.lookup(a_tokens[: 3 * BLOCK], ("", ""))
    assert whole.tokens == 3 * BLOCK - 1 and whole.copy == (a.pages[2], BLOCK - 1)


def test_a_tail_is_taken_over_by_its_continuation_only() -> None:
    pool, cache = _cache()
    tokens = list(range(BLOCK + 40))
    a, chain = _run(cache, tokens)
    cache.finish(a, tokens, chain)
    assert cache.held == 0 and len(cache.idle) == 2  # one full page, one tail
    turn2 = [*tokens, 999, 998]
    m = cache.lookup(turn2, ("", ""))
    assert m.tokens == BLOCK + 40 and m.tail is not None
    b = SlotKV(pool)
    cache.take(m, b, ("", ""))
    assert pool.holders(m.tail) == 1 and m.tail not in cache.idle
    assert cache.lookup(turn2, ("", "")).tokens == BLOCK  # taken: nobody else gets it


def test_a_partly_shared_page_is_copied_and_its_source_let_go() -> None:
    pool, cache = _cache()
    tokens = list(range(2 * BLOCK + 40))
    a, chain = _run(cache, tokens)
    pool.ensure_arrays()
    for arrays in (pool.keys, pool.values):  # every pool row holds its own number
        for i, x in enumerate(arrays):
            arrays[i] = mx.arange(x.size, dtype=mx.float32).reshape(x.shape) + 1000 * i
    cache.finish(a, tokens, chain)
    # parts ways 30 positions into a's second full page / 12 into a's tail
    for shared in (BLOCK + 30, 2 * BLOCK + 12):
        b_tokens = [*tokens[:shared], -5, -6, -7]
        m = cache.lookup(b_tokens, ("", ""))
        src, n = m.copy or (None, 0)
        assert m.tokens == shared and len(m.pages) == shared // BLOCK and n == shared % BLOCK
        held_before = pool.holders(src)
        b = SlotKV(pool)
        b_chain = cache.take(m, b, ("", ""))
        b.add_pages(cache.allocate(-(-len(b_tokens) // BLOCK) - len(b.pages), 1000))
        cache.copy_into(m, b)  # (inline here; the engine posts it to the MLX thread)
        assert pool.holders(src) == held_before and src in cache.idle
        dst = b.pages[len(m.pages)]
        for arrays in (pool.keys, pool.values):
            blocks = arrays[0].reshape(-1, BLOCK, pool.head_dim)
            assert mx.array_equal(blocks[dst, :n], blocks[src, :n])
            assert not mx.array_equal(blocks[dst, n:], blocks[src, n:])
        cache.finish(b, b_tokens[:shared], b_chain)
    assert cache.held == 0


def test_shared_pages_are_freed_when_their_last_holder_lets_go() -> None:
    pool, cache = _cache()
    tokens = list(range(2 * BLOCK + 5))
    a, a_chain = _run(cache, tokens)
    b_tokens = tokens[: 2 * BLOCK] + [5, 6, 7]
    b, b_chain = _run(cache, b_tokens)
    b_pages = list(b.pages)
    assert b_pages[:2] == a.pages[:2] and cache.shared == 2
    cache.finish(a, tokens, a_chain)
    assert all(pool.holders(p) == 1 for p in b_pages[:2])
    cache.finish(b, b_tokens, b_chain)
    assert cache.held == 0
    assert cache.drop_idle() == 4  # two full pages, two tails
    assert pool.free_count == pool.ids


def test_the_default_budget_is_sized_by_the_device() -> None:
    gib = 2**30
    h200 = {"total_memory": 141 * gib, "free_memory": 130 * gib}
    # free after the weights, MLX's cached buffers count as free, 10 % of the device kept
    assert default_kv_budget("gpu", h200, cached=2 * gib) == 132 * gib - int(14.1 * gib)
    small = {"memory_size": 16 * gib}  # no free-memory reading: total less what MLX holds
    assert default_kv_budget("gpu", small, active=8 * gib) == 4 * gib
    assert default_kv_budget("gpu", {"total_memory": 8 * gib, "free_memory": gib}) == gib
    cpu = default_kv_budget("cpu")
    assert cpu == default_kv_budget("gpu", {}) and 0 < cpu <= 16 * gib
    # MLX's cache of freed buffers is held to half of what the budget leaves free
    assert gpu_cache_limit(h200) == int(14.1 * gib) // 2
    assert gpu_cache_limit(small) == 2 * gib


def test_the_default_prefill_budget_is_sized_by_the_device(one_slot: EngineHarness) -> None:
    """256 tokens a tick on a CPU, 1,024 on a GPU (engine.default_prefill_budget); an engine
    given none (this harness) gets its device's."""
    assert default_prefill_budget("cpu") == 256
    assert default_prefill_budget("gpu") == 1024
    engine = one_slot.engine
    want = default_prefill_budget(engine.loaded.device)
    assert engine.config.prefill_budget == want == engine.batcher.prefill_budget


def test_a_page_copy_writes_in_place() -> None:
    """copy_positions must not copy the pool: with the arrays of a large budget, a copy of
    the whole pool per partial match would cost seconds and as much memory again."""
    pool = KVPool(num_layers=4, num_kv_heads=2, head_dim=64, dtype=mx.float32)
    pool.take(64)
    pool.ensure_arrays()
    mx.eval(pool.arrays())
    layer_bytes = pool.keys[0].nbytes
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    pool.copy_positions(3, 9, BLOCK - 1)
    assert mx.get_peak_memory() - before < layer_bytes
