"""The Responses API's stored conversations, for `previous_response_id`: bounded, per tenant.

A response stored (`store` true, the API's default) keeps the whole conversation it ended, as
chat messages: its input (after its own previous response's) and its output. A later request
names it with `previous_response_id` and sends only what is new. The store is in memory and
bounded by count and by characters: the least recently used entries go first, and a request
naming one that is gone (or never was, or belongs to another API key) gets a 400 that says so.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

MAX_RESPONSES = 1024
MAX_CHARACTERS = 64 * 2**20  # of all stored conversations together


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES,
                 max_characters: int = MAX_CHARACTERS) -> None:
        self.max_responses, self.max_characters = max_responses, max_characters
        self._items: OrderedDict[tuple[str | None, str], tuple[list[dict[str, Any]], int]] = (
            OrderedDict())
        self.characters = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tenant: str | None, response_id: str,
            conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(conversation, ensure_ascii=False))
        if size > self.max_characters:
            return  # never kept: a later reference to it is told it is not found
        self._items[(tenant, response_id)] = (conversation, size)
        self.characters += size
        while len(self._items) > self.max_responses or self.characters > self.max_characters:
            _, (_, dropped) = self._items.popitem(last=False)
            self.characters -= dropped

    def get(self, tenant: str | None, response_id: str) -> list[dict[str, Any]] | None:
        """The conversation a response ended (a copy of the list), or None if not stored."""
        key = (tenant, response_id)
        entry = self._items.get(key)
        if entry is None:
            return None
        self._items.move_to_end(key)
        return list(entry[0])
