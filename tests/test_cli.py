"""`slotserve generate`: chat by default with an optional system prompt, --raw for plain text."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import slotserve.engine
from slotserve.actors.messages import Delta
from slotserve.cli import build_parser, main


class _FakeEngine:
    """Stands in for Engine: records what the CLI asks for, streams two deltas."""

    calls: list[tuple[str, Any, dict[str, Any]]] = []

    def __init__(self) -> None:
        self.progress: Any = None
        self.tokenizer = self

    @classmethod
    def load(cls, model: Any, **kwargs: Any) -> _FakeEngine:
        return cls()

    async def __aenter__(self) -> _FakeEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def make_request(self, ids: list[int], **opts: Any) -> tuple[list[int], dict[str, Any]]:
        return ids, opts

    async def _stream(self) -> AsyncIterator[Delta]:
        yield Delta(text="O")
        yield Delta(text="K", finish_reason="stop")

    def chat(self, messages: list[dict[str, Any]], **opts: Any) -> AsyncIterator[Delta]:
        self.calls.append(("chat", messages, opts))
        return self._stream()

    def generate(self, request: tuple[list[int], dict[str, Any]]) -> AsyncIterator[Delta]:
        self.calls.append(("generate", request[0], request[1]))
        return self._stream()


@pytest.fixture()
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> type[_FakeEngine]:
    monkeypatch.setattr(slotserve.engine, "Engine", _FakeEngine)
    _FakeEngine.calls = []
    return _FakeEngine


def test_generate_chats_with_the_system_prompt(fake_engine: type[_FakeEngine],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Hi", "--system", "Be brief.", "--max-tokens", "5"]) == 0
    kind, messages, opts = fake_engine.calls[0]
    assert kind == "chat"
    assert messages == [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi"}]
    assert opts["max_tokens"] == 5
    assert capsys.readouterr().out == "OK\n"


def test_generate_chat_without_system_and_raw(fake_engine: type[_FakeEngine]) -> None:
    assert main(["generate", "Hi"]) == 0
    assert fake_engine.calls[0][:2] == ("chat", [{"role": "user", "content": "Hi"}])
    assert main(["generate", "Hi", "--raw", "--system", "ignored"]) == 0
    assert fake_engine.calls[1][:2] == ("generate", [ord("H"), ord("i")])


def test_generate_has_no_chat_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """Chat is what generate does unless --raw: there is no switch to turn it on."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "Hi", "--chat"])
    assert "--chat" in capsys.readouterr().err
