"""A minimal HTTP/1.1 client for latency figures: one request per kept-alive connection at a
time, the body read as it arrives (chunked or with a length), nothing else.

benchmarks/audio.py measures omni's first audio with it beside httpx: httpx itself spends
~1.3 ms per request on this box (2.2-2.5 ms vs 0.9-1.0 ms for a POST that streams one chunk
back from a bare Hypercorn app), which is the client's time, not the server's.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit


class RawClient:
    def __init__(self, url: str):
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self._head = f"host: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _send(self, request: bytes):
        """Write the request on a kept-alive connection (a fresh one if the server closed it
        meanwhile: its keep-alive timeout); the response head, and when it was sent."""
        while True:
            reused = bool(self._idle)
            reader, writer = self._idle.pop() if reused else await asyncio.open_connection(self.host, self.port)
            t0 = time.perf_counter()
            writer.write(request)
            try:
                return reader, writer, t0, await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                if not reused:
                    raise

    async def post_stream(self, path: str, body: dict) -> dict:
        """POST `body` as JSON; {"first": s to the first body byte, "done": s, "bytes": n}."""
        data = json.dumps(body).encode()
        request = f"POST {path} HTTP/1.1\r\n{self._head}content-length: {len(data)}\r\n\r\n".encode() + data
        reader, writer, t0, head = await self._send(request)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines if x)}
        first, n, chunks = None, 0, []
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                piece = await reader.readexactly(size + 2)
                if size and first is None:
                    first = time.perf_counter() - t0
                n += size
                if status != 200:
                    chunks.append(piece[:-2])
                if size == 0:
                    break
        else:
            size = int(headers.get("content-length", "0"))
            piece = await reader.readexactly(size)
            first = time.perf_counter() - t0 if size else None
            n = size
            chunks.append(piece)
        done = time.perf_counter() - t0
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self._idle.append((reader, writer))
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {b''.join(chunks).decode(errors='replace')[:200]}")
        return {"first": first, "done": done, "bytes": n}

    async def close(self) -> None:
        for _, w in self._idle:
            w.close()
        self._idle.clear()
