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


def test_the_file_store_is_shared_by_every_process_on_the_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.gateway.http.response_store import FileResponseStore

    one, other = FileResponseStore(tmp_path, capacity=2), FileResponseStore(tmp_path, capacity=2)
    one.put(_stored("resp_a"))
    assert other.get("resp_a") == _stored("resp_a")  # (another gateway process's view)
    assert other.get("resp_b") is None
    for response_id in ("..", "b:c.d"):  # any id the API takes is a safe file name
        other.put(_stored(response_id))
    assert one.get("resp_a") is None  # the oldest went past the capacity
    assert one.get("..") == _stored("..") and one.get("b:c.d") == _stored("b:c.d")
    assert one.delete("..") and not other.delete("..")
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".json"]
