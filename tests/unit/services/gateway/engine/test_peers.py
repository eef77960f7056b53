"""One of several gateway processes: its requests travel under wire ids naming it, their
outputs and errors come back by those ids, and a cancel by the client's id or the live list
asks the other processes (services/gateway/engine/peers.py, zmq_client.py)."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from common.messages import (
    Abort,
    FinishReason,
    GatewayAnswer,
    GatewayQuery,
    GenerateRequest,
    Stats,
)
from services.gateway.engine.peers import GatewayPeers
from services.gateway.engine.stream import WireIds
from services.gateway.engine.zmq_client import ZmqEngineClient
from tests.unit.services.gateway.engine.test_zmq_client import FakeOutbox, batch, request


def _client(index: int = 1) -> tuple[ZmqEngineClient, FakeOutbox, FakeOutbox, FakeOutbox]:
    tokenizers, scheduler, peers = FakeOutbox(), FakeOutbox(), FakeOutbox()
    client = ZmqEngineClient(
        tokenizers,  # type: ignore[arg-type]
        scheduler,
        "inproc://gateway-1",
        wire_ids=WireIds(index, 2),
        peers=GatewayPeers(peers, 1, "inproc://gateway-1", itertools.count()),
    )
    return client, tokenizers, scheduler, peers


async def _sent(box: FakeOutbox) -> None:
    """Until the task under test has sent its message to `box` (the event it waits for)."""
    while not box.sent:
        await asyncio.sleep(0)


def test_a_request_travels_under_its_gateways_mark_and_its_outputs_come_back() -> None:
    asyncio.run(_a_request_travels_under_its_gateways_mark_and_its_outputs_come_back())


async def _a_request_travels_under_its_gateways_mark_and_its_outputs_come_back() -> None:
    client, tokenizers, scheduler, _ = _client()
    deltas = client.generate(request("abc"))
    first = asyncio.ensure_future(deltas.__anext__())
    await _sent(tokenizers)
    sent = tokenizers.sent[0]
    assert isinstance(sent, GenerateRequest) and sent.request_id == "g1:abc"
    assert client.is_in_flight("abc")  # (by the client's id)
    client.on_outputs(batch(("g1:abc", 0, "Hi", FinishReason.NONE, 1)))
    assert (await first).text == "Hi"
    await deltas.aclose()  # the client went away: the abort names the wire id
    assert scheduler.sent == [Abort(request_ids=["g1:abc"], reason=int(FinishReason.CANCELLED))]


def test_a_cancel_of_a_request_held_elsewhere_asks_the_other_processes() -> None:
    asyncio.run(_a_cancel_of_a_request_held_elsewhere_asks_the_other_processes())


async def _a_cancel_of_a_request_held_elsewhere_asks_the_other_processes() -> None:
    client, _, scheduler, peers = _client()
    cancel = asyncio.ensure_future(client.cancel("theirs"))
    await _sent(peers)
    (query,) = peers.sent
    assert query == GatewayQuery(
        reply_to="inproc://gateway-1", query_id=query.query_id, what="cancel", request_id="theirs"
    )
    client.peers.on_answer(GatewayAnswer("gateway-0", query.query_id, {"cancelled": True}))
    assert await cancel is True
    assert scheduler.sent == []  # the holder aborts it, under its own wire id


def test_a_peer_that_does_not_answer_holds_nothing() -> None:
    asyncio.run(_a_peer_that_does_not_answer_holds_nothing())


async def _a_peer_that_does_not_answer_holds_nothing() -> None:
    client, _, _, peers = _client()
    assert await client.peers.cancel("gone", timeout=0.01) is False
    assert await client.peer_requests(timeout=0.01) == []
    assert len(peers.sent) == 2


def test_the_live_list_names_the_process_holding_each_request() -> None:
    asyncio.run(_the_live_list_names_the_process_holding_each_request())


async def _the_live_list_names_the_process_holding_each_request() -> None:
    client, _, _, peers = _client()
    rows = asyncio.ensure_future(client.peer_requests())
    await _sent(peers)
    (query,) = peers.sent
    row: dict[str, Any] = {"id": "x", "arrival": 1.0}
    client.peers.on_answer(GatewayAnswer("gateway-0", query.query_id, {"requests": [row]}))
    assert await rows == [{"id": "x", "arrival": 1.0, "gateway": "gateway-0"}]


def test_the_schedulers_rows_name_requests_by_the_clients_id() -> None:
    asyncio.run(_the_schedulers_rows_name_requests_by_the_clients_id())


async def _the_schedulers_rows_name_requests_by_the_clients_id() -> None:
    client, _, scheduler, _ = _client()
    answer = asyncio.ensure_future(client.stats(what="requests"))
    await _sent(scheduler)
    (query,) = scheduler.sent
    client.on_stats(
        Stats(name="scheduler", query_id=query.query_id, data={"requests": [{"id": "g0:a"}]})
    )
    assert (await answer)["requests"] == [{"id": "a"}]
