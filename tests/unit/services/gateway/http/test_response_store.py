"""The bounded store of responses (services/gateway/http/response_store.py)."""

from __future__ import annotations

from services.gateway.http.response_store import ResponseStore, StoredResponse


def _stored(response_id: str) -> StoredResponse:
    return StoredResponse({"id": response_id}, [{"role": "user", "content": response_id}])


def test_the_oldest_go_first_past_the_capacity() -> None:
    store = ResponseStore(capacity=2)
    for response_id in ("a", "b", "c"):
        store.put(_stored(response_id))
    assert store.get("a") is None
    assert store.get("b") == _stored("b") and store.get("c") == _stored("c")
    assert store.delete("b") and not store.delete("b")
    assert store.get("b") is None
