"""One HTTP request to a vLLM server, every wait bounded: connecting, the reply's first byte (the server
samples before it answers), the rest of the reply after it, and a stop request.

urllib's timeout bounds each socket operation, not a request: a server that never answers holds a caller for
the whole timeout, and one that trickles a byte every few seconds holds it forever; neither ends on SIGTERM.
So the reply is read here, in short polls, under three deadlines, with `Connection: close` (the reply ends
when the server closes) and http.client parsing the bytes that came. A stop request (quaero/recipe/stop.py
StopRequest sets `STOP_REQUESTED`) lets a wait run `stop_grace_s` more (`[sampler] stop_grace_s`: a healthy
step may still finish and be checkpointed), then ends it with KeyboardInterrupt: the run is interrupted, its
last checkpoint the resume
point. `abort` (set when the caller's own thread is interrupted) ends it at once.
"""
from __future__ import annotations

import http.client
import io
import socket
import ssl
import threading
import time
import urllib.parse

from quaero.bounded import STOP_REQUESTED
from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger

log = get_logger(__name__)

CONNECT_TIMEOUT_S = 10.0  # a server that accepts no connection (an address that drops packets)
FIRST_BYTE_TIMEOUT_S = 900.0  # one prompt's n completions sampled before the reply starts (request_timeout_s)
REPLY_TIMEOUT_S = 120.0  # the rest of the reply after its first byte (JSON of token ids: seconds at most)
MAX_REPLY_BYTES = 256 << 20  # a reply larger than this is not a completion of quaero's budgets
POLL_S = 0.25  # how often a wait looks at the clock and at a stop request
STOP_GRACE_S = 10.0  # how long a wait continues after a stop request ([sampler] stop_grace_s)


class ReplyTimeout(TimeoutError):
    """A bound above ran out; the message says which."""


def exchange(method: str, url: str, body: bytes | None = None, *, abort: threading.Event | None = None,
             first_byte_s: float | None = None, reply_s: float | None = None,
             stop_grace_s: float | None = None) -> tuple[int, bytes]:
    """(HTTP status, body) of one request to `url`; OSError when nothing usable came back (ReplyTimeout when a
    bound ran out), KeyboardInterrupt when a stop request or `abort` ended the wait. `first_byte_s`, `reply_s`
    and `stop_grace_s` replace FIRST_BYTE_TIMEOUT_S, REPLY_TIMEOUT_S and STOP_GRACE_S (a probe waits seconds,
    a run its `[sampler] request_timeout_s` and `stop_grace_s`)."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    data = body or b""
    head = (f"{method} {target} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nAccept: application/json\r\nConnection: close\r\n\r\n").encode()
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    except TimeoutError:
        raise ReplyTimeout(f"no connection within {CONNECT_TIMEOUT_S:g}s") from None
    with sock:
        if parts.scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        sock.sendall(head + data)
        raw = _read_reply(sock, abort, FIRST_BYTE_TIMEOUT_S if first_byte_s is None else first_byte_s,
                          REPLY_TIMEOUT_S if reply_s is None else reply_s, url,
                          STOP_GRACE_S if stop_grace_s is None else stop_grace_s)
    if not raw:
        raise ConnectionResetError("the connection closed without a reply")
    reply = http.client.HTTPResponse(_Received(raw))
    try:
        reply.begin()
        return reply.status, reply.read()
    except (http.client.HTTPException, ValueError) as e:
        raise ConnectionError(f"an unreadable HTTP reply ({type(e).__name__}: {str(e)[:100]})") from None


def _read_reply(sock: socket.socket, abort: threading.Event | None, first_byte_s: float, reply_s: float,
                url: str, stop_grace_s: float) -> bytes:
    sock.settimeout(POLL_S)
    chunks, size = [], 0
    start = time.monotonic()
    first = stop_seen = None
    while True:
        now = time.monotonic()
        if abort is not None and abort.is_set():
            raise KeyboardInterrupt
        if STOP_REQUESTED.is_set():
            stop_seen = stop_seen or now
            if now - stop_seen >= stop_grace_s:
                log.warning(names.SAMPLER_WAIT_STOPPED_EVENT, url=url, waited_s=round(now - start, 1),
                            note=f"a stop request came and the server had not answered {stop_grace_s:g}s "
                            "later ([sampler] stop_grace_s)")
                raise KeyboardInterrupt
        if first is None and now - start > first_byte_s:
            raise ReplyTimeout(f"no reply within {first_byte_s:g}s ([sampler] request_timeout_s)")
        if first is not None and now - first > reply_s:
            raise ReplyTimeout(f"a reply still incomplete {reply_s:g}s after its first byte "
                               f"({size} bytes came)")
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue
        if not chunk:
            return b"".join(chunks)
        first = first or time.monotonic()
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_REPLY_BYTES:
            raise ConnectionError(f"a reply over {MAX_REPLY_BYTES >> 20} MiB")


class _Received:
    """The bytes of a finished reply, in the socket shape http.client.HTTPResponse reads from."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def makefile(self, *args, **kwargs) -> io.BytesIO:
        return io.BytesIO(self._raw)
