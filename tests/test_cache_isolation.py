"""Prefix reuse stays inside a cache namespace (issue 27): the API key the request
authenticated with (in process: `cache_namespace`) and its `cache_salt`. Across namespaces
the PIN oracle reads 0 cached tokens whatever state the victim's KV is in (idle in the
prefix cache just after its request, still there after other tenants' requests, shared
pages of a busy or idle conversation); within one it still reuses, so one
tenant's agents share their system prompt. The tokens are the same bits either way."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest
from engine_harness import EngineHarness, signal_first

from slotserve.actors.admission import namespace_for
from slotserve.actors.kv_cache import common_prefix
from slotserve.api.app import create_app
from slotserve.api.errors import APIError
from slotserve.api.schemas import parse_chat, parse_completion
from slotserve.api.server import BackgroundServer
from slotserve.engine import Completion, Engine, EngineConfig
from slotserve.kernels.attention import BLOCK

PIN, NEAR, WRONG = "4831", "4830", "7296"

SYSTEM = (
    "You are a careful support agent for a large online shop. You read the whole ticket "
    "before you answer, you never promise a refund you cannot give, you quote the order "
    "number back to the customer, and you keep every answer short, polite and precise. "
    "When you do not know something you say so and you hand the ticket to a human. "
) * 5


BANK = ("You are the assistant of Northwind Bank. You answer questions about accounts, "
        "cards and transfers, you never read a card number or a PIN back to anyone, you "
        "check the customer's identity before you discuss an account, and you keep every "
        "answer short. When a customer reports a lost card you block it at once and tell "
        "them how to order a new one. You do not give investment advice. ") * 2


def victim(pin: str) -> list[dict[str, str]]:
    # the PIN ends the prompt, after more than a page of shared tokens: a guess that differs
    # in its last digits still matches a long prefix, which is what made cached_tokens an
    # oracle
    return [{"role": "system", "content": BANK},
            {"role": "user", "content": f"Please remember my card PIN: {pin}"}]


def agent(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def h() -> Iterator[EngineHarness]:
    harness = EngineHarness(max_slots=2, max_queue=8)
    yield harness
    harness.close()


def ask(h: EngineHarness, messages: list[dict[str, str]], tenant: str | None = None,
        salt: str | None = None, tokens: int = 4, **options: Any) -> Completion:
    out = h.call(lambda: h.engine.chat_complete(
        messages, max_tokens=tokens, temperature=0, cache_namespace=tenant, cache_salt=salt,
        **options))
    assert out.finish_reason in ("stop", "length"), out.error
    return out


def cached(c: Completion) -> int:
    return c.usage.reused_tokens


def drop(h: EngineHarness) -> None:
    async def run() -> int:
        return h.engine.drop_retained()

    h.call(run)


def stage(h: EngineHarness, where: str, tenant: str = "alice", salt: str | None = None) -> None:
    """The victim's PIN prompt, its KV left idle in the cache, just now or behind two other
    tenants' chats."""
    drop(h)
    ask(h, victim(PIN), tenant, salt)
    if where == "behind_others":
        ask(h, [{"role": "user", "content": "Count from one to twenty, slowly, please."}],
            "filler-1")
        ask(h, [{"role": "user", "content": "Name the planets from the sun outwards."}],
            "filler-2")
        adm = h.engine.admission
        assert adm is not None
        tokens = h.engine.render_chat(victim(PIN))
        assert adm.cache.lookup(tokens, namespace_for("key", tenant, salt)).tokens > 0


@pytest.mark.parametrize("where", ["just_now", "behind_others"])
def test_the_pin_oracle_reads_zero_across_namespaces(h: EngineHarness, where: str) -> None:
    across, within = {}, {}
    for guess in (PIN, NEAR, WRONG):
        stage(h, where)
        across[guess] = ask(h, victim(guess), "mallory")
        stage(h, where)
        within[guess] = ask(h, victim(guess), "alice")
    assert {g: cached(c) for g, c in across.items()} == {PIN: 0, NEAR: 0, WRONG: 0}
    # within one namespace the KV is reused (and so would read as the oracle of issue 27):
    # the whole common prefix (whole pages shared, the start of the last one copied), all
    # but the last token for the same prompt
    staged = h.engine.render_chat(victim(PIN))
    assert len(staged) > BLOCK
    for g in (PIN, NEAR, WRONG):
        guess = h.engine.render_chat(victim(g))
        assert cached(within[g]) == min(common_prefix(staged, guess), len(guess) - 1), g
    # the same bits whether the KV was another's (not reused), one's own (reused) or cold
    for guess in (PIN, NEAR, WRONG):
        drop(h)
        cold = ask(h, victim(guess), "alice")
        assert cached(cold) == 0
        assert across[guess].token_ids == within[guess].token_ids == cold.token_ids


def test_global_scope_is_the_old_behaviour_and_none_reuses_nothing(h: EngineHarness) -> None:
    config = h.engine.config
    try:
        config.cache_scope = "global"  # read by every make_request
        stage(h, "just_now")
        assert cached(ask(h, victim(PIN), "mallory")) > 0  # the oracle is open again
        stage(h, "just_now")
        assert cached(ask(h, victim(PIN), "mallory", salt="s")) == 0  # salts still split
        config.cache_scope = "none"
        stage(h, "just_now")
        first = ask(h, victim(PIN), "alice")
        assert cached(first) == 0
        turn2 = [*victim(PIN), {"role": "assistant", "content": first.text},
                 {"role": "user", "content": "Thanks."}]
        assert cached(ask(h, turn2, "alice")) == 0  # not even one's own next turn
        for question in ("Where is my order?", "Can I change my address?", "Refund?"):
            assert cached(ask(h, agent(question), "alice")) == 0
        adm = h.engine.admission
        assert adm is not None and not adm.cache.idle  # nothing kept that nobody could use
    finally:
        config.cache_scope = "key"


def test_different_cache_salts_never_share(h: EngineHarness) -> None:
    for salt, other in (("s1", "s2"), ("s1", None), (None, "s1")):
        stage(h, "just_now", salt=salt)
        assert cached(ask(h, victim(PIN), "alice", salt=other)) == 0
        stage(h, "behind_others", salt=salt)
        assert cached(ask(h, victim(PIN), "alice", salt=other)) == 0
        stage(h, "just_now", salt=salt)
        assert cached(ask(h, victim(PIN), "alice", salt=salt)) > 0
    drop(h)
    ask(h, agent("Where is my order 1234?"), "alice", "s1")
    assert cached(ask(h, agent("My parcel is late."), "alice", "s2")) == 0
    assert cached(ask(h, agent("My parcel is late."), "alice", "s1")) >= 2 * BLOCK


def test_one_tenants_agents_share_the_system_prompt_and_no_one_else(h: EngineHarness) -> None:
    engine = h.engine
    assert len(engine.render_chat(agent("x"))) > 2 * BLOCK
    drop(h)
    ask(h, agent("Where is my order 1234?"), "acme")
    mine = ask(h, agent("Can I change the delivery address?"), "acme", tokens=12)
    assert cached(mine) == common_prefix(engine.render_chat(agent("Where is my order 1234?")),
                                         engine.render_chat(agent("Can I change the delivery "
                                                                  "address?")))
    assert cached(mine) >= 2 * BLOCK
    theirs = ask(h, agent("Can I change the delivery address?"), "globex", tokens=12)
    assert cached(theirs) == 0
    # the first agent's conversation is idle in the cache by now: still acme's alone
    adm = engine.admission
    assert adm is not None and adm.cache.idle
    assert cached(ask(h, agent("Do you ship to Norway?"), "acme")) >= 2 * BLOCK
    assert cached(ask(h, agent("Do you ship to Norway?"), "initech")) == 0
    drop(h)
    cold = ask(h, agent("Can I change the delivery address?"), "acme", tokens=12)
    assert cached(cold) == 0
    assert mine.token_ids == theirs.token_ids == cold.token_ids


def test_a_busy_conversation_shares_its_pages_only_with_its_namespace(
        h: EngineHarness) -> None:
    engine = h.engine
    drop(h)
    plan = agent("Write a long plan for handling a lost parcel.")
    out: dict[str, Completion] = {}

    async def both(tenant: str) -> None:
        decoding = anyio.Event()

        async def short() -> None:
            await decoding.wait()
            out[tenant] = await engine.chat_complete(
                agent("What is your returns policy?"), max_tokens=8, temperature=0.7, seed=3,
                cache_namespace=tenant)

        request = engine.make_request(engine.render_chat(plan), max_tokens=32, temperature=0,
                                      ignore_eos=True, cache_namespace="acme")
        async with anyio.create_task_group() as tg:
            tg.start_soon(short)
            await engine.collect(signal_first(engine.generate(request), decoding))

    for tenant in ("globex", "acme"):
        drop(h)
        h.call(lambda t=tenant: both(t))
    assert cached(out["globex"]) == 0 and cached(out["acme"]) >= 2 * BLOCK
    assert out["globex"].token_ids == out["acme"].token_ids  # seeded sampling, same bits


def test_namespace_for() -> None:
    assert namespace_for("key") == namespace_for("key", None, None) == ("", "")
    assert namespace_for("key", "a") == ("a", "") != namespace_for("key", "b")
    assert namespace_for("key", "a", "s") == ("a", "s") != namespace_for("key", "a", "t")
    assert namespace_for("global", "a", "s") == namespace_for("global", "b", "s") == ("", "s")
    assert namespace_for("none", "a", "s") is None
    with pytest.raises(ValueError, match="cache scope"):
        namespace_for("tenant")
    with pytest.raises(ValueError, match="cache_salt must be a string"):
        namespace_for("key", "a", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_scope"):
        Engine(EngineConfig(cache_scope="everyone"))


def test_cache_salt_in_request_bodies() -> None:
    from slotserve.api.anthropic import parse_messages

    user = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": user, "cache_salt": "s"}).options["cache_salt"] == "s"
    assert parse_completion({"prompt": "hi", "cache_salt": "s"}).options["cache_salt"] == "s"
    assert parse_messages({"messages": user, "max_tokens": 4,
                           "cache_salt": "s"}).options["cache_salt"] == "s"
    assert "cache_salt" not in parse_chat({"messages": user}).options
    for bad in (5, "", "x" * 1025, ["s"]):
        with pytest.raises(APIError) as err:
            parse_chat({"messages": user, "cache_salt": bad})
        assert err.value.status == 400 and err.value.param == "cache_salt"


# ---- over HTTP: the API key is the namespace --------------------------------------------------

@pytest.fixture(scope="module")
def srv() -> Iterator[BackgroundServer]:
    server = BackgroundServer(create_app(EngineConfig(max_slots=2, max_queue=8),
                                         api_key=["alice-key", "mallory-key"])).start()
    yield server
    server.stop()


def post(srv: BackgroundServer, key: str, messages: list[dict[str, str]],
         **body: Any) -> dict[str, Any]:
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"messages": messages, "max_tokens": 4, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def http_cached(answer: dict[str, Any]) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def http_drop(srv: BackgroundServer) -> None:
    async def run() -> int:
        engine = srv.state.engine
        assert engine is not None
        return engine.drop_retained()

    srv.call(run())


def test_http_pin_oracle_reads_zero_for_another_key(srv: BackgroundServer) -> None:
    answers = {}
    for key in ("mallory-key", "alice-key"):
        http_drop(srv)
        post(srv, "alice-key", victim(PIN))
        answers[key] = post(srv, key, victim(PIN))
    assert http_cached(answers["mallory-key"]) == 0
    assert http_cached(answers["alice-key"]) > 0
    assert answers["mallory-key"]["choices"][0]["message"] == \
        answers["alice-key"]["choices"][0]["message"]
    # an HTTP request's namespace is its key's, not the in-process default one
    engine = srv.state.engine
    assert engine is not None
    http_drop(srv)
    srv.call(engine.chat_complete(victim(PIN), max_tokens=4, temperature=0))
    assert http_cached(post(srv, "alice-key", victim(PIN))) == 0


def test_http_cache_salt(srv: BackgroundServer) -> None:
    http_drop(srv)
    post(srv, "alice-key", victim(PIN), cache_salt="team-a")
    assert http_cached(post(srv, "alice-key", victim(PIN), cache_salt="team-b")) == 0
    http_drop(srv)
    post(srv, "alice-key", victim(PIN), cache_salt="team-a")
    assert http_cached(post(srv, "alice-key", victim(PIN), cache_salt="team-a")) > 0
    assert http_cached(post(srv, "alice-key", victim(PIN))) == 0  # no salt is another one
    r = httpx.post(srv.url + "/v1/completions", timeout=60,
                   headers={"Authorization": "Bearer alice-key"},
                   json={"prompt": "My card PIN is 4831", "max_tokens": 2, "cache_salt": 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
