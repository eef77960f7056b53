"""Resumes: the gateway's requests lost to the death of a process behind it, sent again.

A request lost with the scheduler (or whose attempt the scheduler failed as `resumable`: the
worker died) waits, paused, until the scheduler says again what it serves (`resume_lost`);
one a dead detokenizer or tokenizer may have held is sent again at once. Each is sent as its
stream's next attempt (services/gateway/engine/stream.py): a new wire id, the tokens it has
streamed. Past `timeout` seconds paused, it fails with a retryable 503; one that cannot be
resumed fails with it at once, as does everything with `timeout` 0.
"""

from __future__ import annotations

import asyncio
import logging

from common.ipc import Outbox, Sender
from common.messages import Abort, FinishReason
from services.gateway.engine.client import RequestFailed
from services.gateway.engine.stream import Stream

log = logging.getLogger(__name__)


class Resumes:
    """Sends the engine client's lost requests again; it shares the client's stream tables."""

    def __init__(
        self,
        streams: dict[str, Stream],
        by_wire: dict[str, Stream],
        tokenizers: Outbox,
        scheduler: Sender,
        timeout: float,
    ) -> None:
        self.streams = streams  # by the client's request id
        self.by_wire = by_wire  # by the id the current attempt travels under
        self.tokenizers = tokenizers
        self.scheduler = scheduler
        self.timeout = timeout  # seconds a lost request waits to be resumed (0: it fails)

    def lose_all(self, why: str) -> int:
        """The scheduler died: every request waits to be resumed (or fails at once, when it
        cannot be). Returns how many wait."""
        lost = 0
        for stream in self.streams.values():
            if self.can_resume(stream):
                self.lose(stream, why)
                lost += 1
            else:
                stream.queue.put_nowait(RequestFailed(503, f"{why}; retry the request"))
        return lost

    def resend_all(self, why: str) -> int:
        """The detokenizer died: outputs it had not passed on are lost, also those of
        requests the scheduler has already finished (no error will come for them): send every
        request again now from the tokens it has (or fail it when it cannot be resumed).
        Returns how many were sent."""
        sent = 0
        for stream in list(self.streams.values()):
            if self.can_resume(stream):
                self._send_attempt(stream, why)
                sent += 1
            else:
                stream.queue.put_nowait(RequestFailed(503, f"{why}; retry the request"))
        return sent

    def resend_waiting(self, why: str) -> int:
        """A tokenizer died: requests whose current attempt has no output yet (new ones,
        resumed ones) may have died with it; send them again now (a live or restarted
        tokenizer takes them), the earlier attempt aborted in case it had reached the
        scheduler. Returns how many."""
        waiting = [s for s in self.streams.values() if not s.attempt_has_output and not s.is_lost]
        for stream in waiting:
            self._send_attempt(stream, why)
        return len(waiting)

    def can_resume(self, stream: Stream) -> bool:
        return self.timeout > 0 and stream.is_resumable

    def lose(self, stream: Stream, why: str) -> None:
        """The request's attempt died with a process: it waits to be resumed."""
        if stream.is_lost:
            return
        loop = asyncio.get_running_loop()
        stream.lost_at = lost_at = loop.time()
        log.warning(
            "%s: paused after %d tokens, to resume",
            why,
            len(stream.token_ids),
            extra={"request_id": stream.request.request_id},
        )
        loop.call_later(self.timeout, self._give_up, stream, lost_at)

    def _give_up(self, stream: Stream, lost_at: float) -> None:
        if stream.lost_at == lost_at:  # (else resumed meanwhile, or lost again later)
            stream.lost_at = None
            stream.queue.put_nowait(
                RequestFailed(
                    503,
                    f"the engine did not come back within {self.timeout:g} s to resume "
                    "the request; retry the request",
                )
            )

    def resume_lost(self) -> None:
        """The engine serves again: send every lost request again, where it stopped."""
        lost = [s for s in self.streams.values() if s.is_lost]
        for stream in lost:
            self._send_attempt(stream, "the engine serves again")

    def _send_attempt(self, stream: Stream, why: str) -> None:
        """Send the stream's next attempt; the earlier one's id is forgotten and aborted
        (it may still run if it reached the scheduler: its outputs would be moot)."""
        log.info(
            "%s: sending it again after %d tokens",
            why,
            len(stream.token_ids),
            extra={"request_id": stream.request.request_id},
        )
        old = stream.wire_id
        self.by_wire.pop(old, None)
        self.scheduler.send(Abort(request_ids=[old], reason=int(FinishReason.CANCELLED)))
        request = stream.next_attempt()
        self.by_wire[request.request_id] = stream
        self.tokenizers.send(request)
