"""The prefix cache's recurrent-state snapshots (slotserve.actors.state_snapshots) on a tiny
qwen3_5 model, without the engine: where snapshots are kept, what a lookup resumes from,
what they cost in the budget and when they go."""

from __future__ import annotations  # noqa: I001  (slotserve preloads OpenBLAS before MLX)

from pathlib import Path
from typing import Any

import slotserve  # noqa: F401
import mlx.core as mx
import numpy as np
import pytest

from slotserve.actors.kv_cache import KVCache
from slotserve.actors.state_snapshots import StateSnapshots
from slotserve.kernels.attention import BLOCK
from slotserve.model.layers import Batch
from slotserve.model.loader import load

from test_oracle_qwen3_5 import TEXT, randomize

transformers = pytest.importorskip("transformers")

NS = ("tenant", "")
TOKENS = [int(t) for t in np.random.RandomState(4).randint(0, 320, 700)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    hf = randomize(transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT)), 6)
    path: Path = tmp_path_factory.mktemp("qwen3_5_snapshots")
    hf.save_pretrained(path, safe_serialization=True)
    return load(path, device="cpu", with_tokenizer=False).model


def _cache(model: Any, interval: int = 2) -> KVCache:
    kv = model.new_kv()
    cache = KVCache(kv.pool)
    cache.snapshots = StateSnapshots(kv.recurrent.shape.nbytes, kv.pool.page_bytes, interval)
    return cache


def _serve(model: Any, cache: KVCache, tokens: list[int], ns: Any, chunk: int = 96) -> Any:
    """Place `tokens` as the cache would, prefill the rest in aligned chunks, publish and
    finish; returns the match it started from and the last logits."""
    kv = model.new_kv()
    match = cache.lookup(tokens, ns)
    chain = cache.take(match, kv, ns)
    if match.copy is not None:  # a tail's positions before its state, into a page of its own
        kv.add_pages(cache.allocate(1, 1 << 20))
        cache.copy_into(match, kv)
    start, logits = match.tokens, None
    while start < len(tokens):
        end = min(len(tokens), start + chunk)
        logits = model(mx.array(tokens[start:end]), Batch.build([(kv, start, end - start)]),
                       [end - start - 1])[0]
        start = end
        cache.publish(kv, tokens[:start], chain)
    cache.finish(kv, tokens, chain)
    return match, logits


def test_snapshots_every_interval_and_a_resume_equals_cold(model: Any) -> None:
    cache = _cache(model)
    snaps = cache.snapshots
    assert snaps is not None
    _serve(model, cache, TOKENS[:600], NS)  # chunks of 96: the last, 576..599, recurrent
    assert len(snaps.states) == 2  # at 256 and 512 (every 2 pages), none at 128 or 384
    assert list(snaps.tails.values())[0][0] == 576  # the deepest, in the tail page
    # each costs its bytes in pages, counted resident (what the budget bounds), never held
    kv = model.new_kv()
    assert snaps.cost == -(-kv.recurrent.shape.nbytes // kv.pool.page_bytes)
    pages = cache.pool.ids - cache.pool.free_count
    assert cache.resident == pages + 3 * snaps.cost
    assert cache.held == pages - len(cache.idle)
    match, warm = _serve(model, cache, TOKENS, NS)
    assert match.tokens == 576 and match.state is not None and snaps.taken == 1
    # its positions before 576 copied out of the tail page, which stays for the next turn
    assert match.copy is not None and match.copy[1] == 576 - 4 * BLOCK
    assert match.copy[0] in snaps.tails and match.copy[0] in cache.idle
    _, cold = _serve(model, _cache(model), TOKENS, NS)
    assert mx.array_equal(warm, cold)


def test_a_resume_cuts_the_page_match_to_its_deepest_snapshot(model: Any) -> None:
    cache = _cache(model, interval=4)
    _serve(model, cache, TOKENS[:500], NS)  # three full pages, no snapshot (every 4 pages)
    assert cache.snapshots is not None and not cache.snapshots.states
    assert list(cache.snapshots.tails.values())[0][0] == 480
    other = TOKENS[:450] + [(t + 1) % 320 for t in TOKENS[450:]]  # parts ways before 480
    assert cache._lookup_pages(other, NS).tokens >= 3 * BLOCK  # its full pages (and more)
    match, _ = _serve(model, cache, other, NS)
    assert match.tokens == 0 and match.pages == []  # pages alone are no use: cold


def test_no_namespace_marks_nothing(model: Any) -> None:
    cache = _cache(model)
    kv = model.new_kv()
    cache.take(cache.lookup(TOKENS, None), kv, None)
    model(mx.array(TOKENS[:300]), Batch.build([(kv, 0, 300)]), [299])
    assert kv.recurrent.marks == {}


def test_evicting_a_page_drops_its_snapshot_and_snapshots_go_for_room(model: Any) -> None:
    cache = _cache(model)
    snaps = cache.snapshots
    assert snaps is not None
    _serve(model, cache, TOKENS[:300], NS)
    assert len(snaps.states) == 1
    page_of_256 = cache.pages[next(iter(snaps.states))]
    while page_of_256 in cache.idle:
        cache.evict_one("budget")
    assert not snaps.states
    _serve(model, cache, TOKENS[:300], NS)
    assert len(snaps.states) == 1
    # a budget with room for the request's pages alone: idle pages and snapshots give way
    cache.allocate(3, budget=3)
    assert not snaps.states and not cache.idle


def _decode(model: Any, cache: KVCache, prompt: list[int], more: list[int], ns: Any) -> None:
    """`prompt` prefilled (chunks of 96), then `more` fed one position per step as decode
    rows are, publishing as the engine does, and finished."""
    kv = model.new_kv()
    chain = cache.take(cache.lookup(prompt, ns), kv, ns)
    assert chain.keys == [] and kv.recurrent.resumed_at == 0  # (a cold cache)
    tokens, start = prompt + more, 0
    while start < len(tokens):
        end = min(len(prompt), start + 96) if start < len(prompt) else start + 1
        model(mx.array(tokens[start:end]), Batch.build([(kv, start, end - start)]),
              [end - start - 1])
        start = end
        cache.publish(kv, tokens[:start], chain)
    cache.finish(kv, tokens, chain)


def test_decoded_pages_are_never_published_and_a_settled_ledger_resumes_past_them(
        model: Any) -> None:
    """Decoded positions' K/V (and state) are not a cold prefill's: the page the decode
    filled stays private and the follow-up resumes where the prompt's prefill stopped. A
    settle pass (the finished ledger prefilled again up to its last whole sub-chunk, from
    that state) publishes it, leaves its state at 384 (a page end off the interval) and a
    follow-up resumes there, with the logits of a cold prefill."""
    cache = _cache(model)
    snaps = cache.snapshots
    assert snaps is not None
    _decode(model, cache, TOKENS[:300], TOKENS[300:400], NS)  # 300..399 decoded
    assert len(cache.pages) == 2 and len(snaps.states) == 1  # pages 0-1, 256's state
    assert [pos for pos, _ in snaps.tails.values()] == [288]  # in page 2, unpublished
    follow = TOKENS[:420]
    assert cache.lookup(follow, NS).tokens == 288
    match, _ = _serve(model, cache, TOKENS[:384], NS)  # the settle pass
    assert match.tokens == 288 and match.copy is not None
    assert len(cache.pages) == 3 and len(snaps.states) == 2  # page 2 and 384's state
    assert [pos for pos, _ in snaps.tails.values()] == [288]  # kept (a repeat's resume)
    match, warm = _serve(model, cache, follow, NS)
    assert match.tokens == 384 and match.state is not None and match.copy is None
    _, cold = _serve(model, _cache(model), follow, NS)
    assert mx.array_equal(warm, cold)
