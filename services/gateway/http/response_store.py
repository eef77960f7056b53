"""The Responses API's stored responses (`store`, true unless false): the last
`MAX_STORED_RESPONSES` in this gateway's memory, oldest dropped first, each with its
conversation so far (chat messages), which a request naming it as `previous_response_id`
continues. They do not survive a restart and are not shared between gateways."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

MAX_STORED_RESPONSES = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response and the conversation a continuation of it starts from."""

    response: dict[str, Any]  # as answered
    history: list[dict[str, Any]]  # the conversation after it, as chat messages


class ResponseStore:
    """The stored responses of one gateway, at most `capacity`, oldest dropped first."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response["id"]] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
