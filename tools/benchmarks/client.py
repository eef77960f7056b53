"""A lean HTTP/1.1 client for streamed completions: asyncio streams, no HTTP library.

The load generator shares the CPU with the server it measures; with httpx, reading one SSE
event cost ~70 us of client CPU, as much as the whole server spent on the token. This client
keeps one keep-alive connection per concurrent stream, sends a POST, and reads a chunked
(or sized) body, splitting it into `data:` events as bytes arrive: ~10x cheaper. Plain
http:// only; tools/bench uses httpx for https:// URLs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class HttpError(Exception):
    """A non-200 answer (its status and the start of its body) or a broken exchange."""


class SseConnection:
    """One keep-alive connection; `stream` yields the `data:` payloads of one response."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise ValueError(f"{url}: the lean client speaks plain http:// only")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.base = parts.path.rstrip("/")
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._status_line = b""  # read ahead by _status_arrives

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._reader = self._writer = None

    async def stream(self, path: str, body: bytes) -> AsyncIterator[bytes]:
        """POST `body` (JSON) and yield each event's data, e.g. b'{"id": ...}' or b'[DONE]'."""
        request = (
            f"POST {self.base}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        reused = self._writer is not None
        await self._send(request)
        if reused and not await self._status_arrives():
            # the server closed the idle keep-alive connection (llama-server does after 5 s
            # or 5 requests): nothing of this request was read, so send it on a new one
            await self.close()
            await self._send(request)
        try:
            status, chunked, length, close = await self._head()
            if status != 200:
                raise HttpError(f"HTTP {status}: {(await self._body(chunked, length))[:200]!r}")
            async for data in self._events(chunked, length):
                yield data
        except (OSError, asyncio.IncompleteReadError, ValueError) as e:
            await self.close()
            raise HttpError(f"{type(e).__name__}: {e}") from None
        except BaseException:  # cancelled or abandoned mid-body: the connection is unusable
            await self.close()
            raise
        if close:
            await self.close()

    async def _send(self, request: bytes) -> None:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(request)
        self._status_line = b""

    async def _status_arrives(self) -> bool:
        """Read the status line now; False if the connection turns out closed."""
        assert self._reader is not None
        try:
            self._status_line = await self._reader.readline()
        except OSError:
            return False
        return bool(self._status_line)

    async def _head(self) -> tuple[int, bool, int, bool]:
        assert self._reader is not None
        line = self._status_line or await self._reader.readline()
        self._status_line = b""
        parts = line.split(b" ", 2)
        if len(parts) < 2:
            raise ValueError(f"no HTTP status line: {line[:80]!r}")
        status = int(parts[1])
        chunked, length, close = False, -1, False
        while (line := await self._reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding":
                chunked = b"chunked" in value
            elif name == b"content-length":
                length = int(value)
            elif name == b"connection":
                close = value == b"close"
        return status, chunked, length, close

    async def _pieces(self, chunked: bool, length: int) -> AsyncIterator[bytes]:
        """The body as it arrives: de-chunked, or `length` bytes."""
        assert self._reader is not None
        if not chunked:
            reader = self._reader
            yield await (reader.readexactly(length) if length >= 0 else reader.read())
            return
        while True:
            size = int((await self._reader.readline()).split(b";")[0], 16)
            if size == 0:
                await self._reader.readline()  # the empty trailer
                return
            yield (await self._reader.readexactly(size + 2))[:-2]

    async def _body(self, chunked: bool, length: int) -> bytes:
        return b"".join([piece async for piece in self._pieces(chunked, length)])

    async def _events(self, chunked: bool, length: int) -> AsyncIterator[bytes]:
        buf = b""
        async for piece in self._pieces(chunked, length):
            buf += piece
            while (end := buf.find(b"\n\n")) >= 0:  # an event ends at a blank line
                event, buf = buf[:end], buf[end + 2 :]
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:]
