"""The Responses API's stored responses (`store`, true unless false): the last
`MAX_STORED_RESPONSES`, oldest dropped first, each with its conversation so far (chat
messages), which a request naming it as `previous_response_id` continues.

With one gateway process they are kept in its memory (`ResponseStore`). With several
(--gateway-processes), a follow-up may reach another process than the one that answered,
so they are kept in files in the run directory, one per response, which every gateway
process of the server reads and writes (`FileResponseStore`); they then also survive a
gateway process's restart, though not the server's. Gateways on other hosts (compose)
share nothing."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any, Protocol

import orjson

MAX_STORED_RESPONSES = 1024


@dataclasses.dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response and the conversation a continuation of it starts from."""

    response: dict[str, Any]  # as answered
    history: list[dict[str, Any]]  # the conversation after it, as chat messages


class StoresResponses(Protocol):
    """Where the Responses API keeps what `previous_response_id` may name."""

    capacity: int

    def put(self, stored: StoredResponse) -> None: ...

    def get(self, response_id: str) -> StoredResponse | None: ...

    def delete(self, response_id: str) -> bool: ...


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


class FileResponseStore:
    """The stored responses of every gateway process on this host, one file each in
    `folder` (named by a hash of the id: ids may hold any of [A-Za-z0-9._:-]), written
    whole under a temporary name and renamed, so a reader never sees half of one; past
    `capacity` the oldest files go."""

    def __init__(self, folder: Path, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.folder = folder
        self.capacity = capacity
        folder.mkdir(parents=True, exist_ok=True)

    def _path(self, response_id: str) -> Path:
        return self.folder / (hashlib.sha256(response_id.encode()).hexdigest() + ".json")

    def put(self, stored: StoredResponse) -> None:
        path = self._path(stored.response["id"])
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(orjson.dumps({"response": stored.response, "history": stored.history}))
        tmp.replace(path)
        self._drop_oldest()

    def get(self, response_id: str) -> StoredResponse | None:
        try:
            data = orjson.loads(self._path(response_id).read_bytes())
        except FileNotFoundError:
            return None
        if data["response"].get("id") != response_id:  # (a hash collision: not this one)
            return None
        return StoredResponse(data["response"], data["history"])

    def delete(self, response_id: str) -> bool:
        if self.get(response_id) is None:
            return False
        self._path(response_id).unlink(missing_ok=True)
        return True

    def _drop_oldest(self) -> None:
        files = list(self.folder.glob("*.json"))
        if len(files) <= self.capacity:
            return
        for path in sorted(files, key=_mtime)[: len(files) - self.capacity]:
            path.unlink(missing_ok=True)  # (another process may have dropped it first)


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0
