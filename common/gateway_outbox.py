"""What a process sends the gateway, with several gateway processes: each message to the
gateway it concerns.

A gateway process sends each request under a wire id that names it (common/wire_id.py),
so the owner of a request's messages is read off its id. With one gateway process
everything goes to its inbox.

Every message a gateway receives, and how it gets there:

    OutputBatch        detokenizer           split by request: each gateway its own rows
    RequestError       tokenizer, scheduler, the owner of its request_id (an id no gateway
    Retokenize         router, detokenizer   owns, every gateway: each ignores an unknown id)
    ModelChanged       scheduler             every gateway: each serves the model
    LorasChanged       scheduler             every gateway
    ProcessDown, Drain supervisor            every gateway (services/launch.py)
    Stats, SwapResult, TokenizeResult,       replies, sent to the asker's `reply_to` inbox,
    LoraAdapterResult, Pong, PeerCancelled   never through here

Only the senders of the upper rows hold a GatewayOutbox; the routing itself is `route`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from common.ipc import Outbox
from common.messages import OutputBatch, RequestError, Retokenize
from common.wire_id import owner


def route(msg: Any, num_gateways: int) -> list[tuple[int, Any]]:
    """(gateway index, message) for each gateway that gets a part of `msg`, by index."""
    everyone = list(range(num_gateways))
    if isinstance(msg, RequestError | Retokenize):
        index = owner(msg.request_id, num_gateways)
        return [(i, msg) for i in ([index] if index is not None else everyone)]
    if isinstance(msg, OutputBatch):
        return _split_outputs(msg, num_gateways)
    return [(i, msg) for i in everyone]


def _split_outputs(batch: OutputBatch, num_gateways: int) -> list[tuple[int, OutputBatch]]:
    """One batch per owning gateway with its rows, in the batch's order (rows whose id no
    gateway owns go to every gateway, which ignore them)."""
    if num_gateways == 1:
        return [(0, batch)]
    rows: dict[int, list[int]] = {}
    for row, rid in enumerate(batch.request_ids):
        index = owner(rid, num_gateways)
        for i in [index] if index is not None else range(num_gateways):
            rows.setdefault(i, []).append(row)
    if len(rows) == 1:
        return [(next(iter(rows)), batch)]
    return [(i, _select(batch, picked)) for i, picked in sorted(rows.items())]


def _select(batch: OutputBatch, rows: list[int]) -> OutputBatch:
    """The batch's `rows`: every field is [num_reqs] or empty (not sent)."""
    num_reqs = len(batch.request_ids)
    fields = {}
    for field in dataclasses.fields(batch):
        values = getattr(batch, field.name)
        if values and len(values) != num_reqs:
            raise ValueError(f"OutputBatch.{field.name} has {len(values)} rows, not {num_reqs}")
        fields[field.name] = [values[r] for r in rows] if values else []
    return OutputBatch(**fields)


class GatewayOutbox:
    """The sender's side: one outbox per gateway process, each message routed by `route`."""

    def __init__(self, boxes: list[Outbox]) -> None:
        self.boxes = boxes

    def send(self, msg: Any) -> None:
        for index, part in route(msg, len(self.boxes)):
            self.boxes[index].send(part)
