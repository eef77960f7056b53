"""The id a request travels under behind the gateway (its *wire id*), which names the
gateway process that owns it, so that any process can tell the owner from the id alone and
keep no table:

    client id "abc" at gateway-1 ──▶ wire id "g1:abc"   (resumed: "g1:abc/resume-1")

With one gateway process the wire id is the client's id. Minted by the gateway only
(services/gateway/engine/stream.py); read by common/gateway_outbox.py, which routes a
request's messages to its owner, and by the scheduler, which ends a dead gateway's requests.
"""

from __future__ import annotations

_SEP = ":"


def wire_id(gateway: int, num_gateways: int, request_id: str) -> str:
    """The id a request of gateway `gateway` travels under (with one gateway: its own)."""
    return request_id if num_gateways == 1 else f"g{gateway}{_SEP}{request_id}"


def owner(wire: str, num_gateways: int) -> int | None:
    """The index of the gateway that sent the request `wire`, or None when the id names
    none of them (with one gateway: 0, whatever the id)."""
    if num_gateways == 1:
        return 0
    head, sep, _ = wire.partition(_SEP)
    if not sep or not head.startswith("g") or not head[1:].isdigit():
        return None
    index = int(head[1:])
    return index if index < num_gateways else None


def client_id(wire: str, num_gateways: int) -> str:
    """The id the client gave (or the gateway minted) for the request sent as `wire`."""
    if owner(wire, num_gateways) is None or num_gateways == 1:
        return wire
    return wire.partition(_SEP)[2]
