"""A small HTTP proxy in front of an S3 server (moto, SeaweedFS): it records every request
(method, object key, byte range, bytes sent back), can fail a share of them the way S3 does when
it throttles (503 SlowDown) or when a connection drops, and can cap the bytes per second it
carries in each direction, as one node's network link (``S3Proxy(upstream, link=20e6)``): a
simulated node reaches the store only through its own proxy. Clients point their endpoint at
it instead of the server."""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade"}

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass(frozen=True)
class Request:
    method: str
    key: str
    """``bucket/key`` of the object (the path, unquoted, without the leading slash)."""
    query: str
    range: str | None
    sent: int
    """Response body bytes."""
    received: int
    """Request body bytes."""
    status: int
    arrived: float = 0.0
    """``time.monotonic()`` when the request line came in, and when the answer was ready."""
    answered: float = 0.0


class Link:
    """One direction of a link of ``rate`` bytes per second, shared by every connection
    through it: each transfer (a response a chunk at a time, a request body whole) waits for
    its turn and takes its bytes' time."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = time.monotonic()
        self._lock = threading.Lock()

    def carry(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + nbytes / self.rate
            done = self._free_at
        time.sleep(max(0.0, done - now))


_CHUNK = 1 << 20


class S3Proxy:
    def __init__(self, upstream: str, link: float | None = None) -> None:
        parsed = urlsplit(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.down = Link(link) if link else None
        """What the node receives (response bodies), at most ``link`` bytes per second."""
        self.up = Link(link) if link else None
        """What the node sends (request bodies)."""
        self.requests: list[Request] = []
        self.fail_every = 0
        """Fail every n-th data request (GET of an object, PUT of a part or object); 0: none."""
        self.failures = 0
        self._count = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> S3Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.fail_every = 0
            self.failures = 0
            self._count = 0

    def gets(self, prefix: str = "") -> list[Request]:
        """Object GETs (not listings) under ``bucket/prefix``."""
        return [
            r
            for r in self.requests
            if r.method == "GET"
            and "/" in r.key
            and r.key.startswith(prefix)
            and "list-type" not in r.query
            and "uploads" not in r.query
        ]

    def _read_body(self, handler: BaseHTTPRequestHandler) -> bytes:
        if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                size = int(handler.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(body)
                body += handler.rfile.read(size)
                handler.rfile.readline()
        length = int(handler.headers.get("Content-Length") or 0)
        return handler.rfile.read(length) if length else b""

    def _should_fail(self, method: str, query: str, key: str) -> bool:
        data_request = (method == "GET" and "/" in key and "list-type" not in query) or (
            method == "PUT" and "/" in key
        )
        if not data_request or not self.fail_every:
            return False
        with self._lock:
            self._count += 1
            fail = self._count % self.fail_every == 0
            self.failures += fail
        return fail

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        arrived = time.monotonic()
        body = self._read_body(handler)
        split = urlsplit(handler.path)
        key = unquote(split.path.lstrip("/"))
        if self._should_fail(handler.command, split.query, key):
            if self.failures % 2:  # alternate: throttling answer, then a dropped connection
                handler.send_response(503)
                handler.send_header("Content-Type", "application/xml")
                handler.send_header("Content-Length", str(len(SLOW_DOWN)))
                handler.end_headers()
                handler.wfile.write(SLOW_DOWN)
            else:
                handler.close_connection = True
                handler.connection.close()
            return
        if self.up is not None and body:
            self.up.carry(len(body))
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP}
        headers["Content-Length"] = str(len(body))
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(handler.command, handler.path, body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
        finally:
            conn.close()
        with self._lock:
            self.requests.append(
                Request(
                    handler.command,
                    key,
                    split.query,
                    handler.headers.get("Range"),
                    len(payload),
                    len(body),
                    response.status,
                    arrived,
                    time.monotonic(),
                )
            )
        handler.send_response(response.status)
        head = handler.command == "HEAD"
        for name, value in response.getheaders():
            if name.lower() not in _HOP and (head or name.lower() != "content-length"):
                handler.send_header(name, value)
        if not head:
            handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        if handler.command != "HEAD":
            for start in range(0, len(payload), _CHUNK):
                chunk = payload[start : start + _CHUNK]
                if self.down is not None:
                    self.down.carry(len(chunk))
                handler.wfile.write(chunk)
