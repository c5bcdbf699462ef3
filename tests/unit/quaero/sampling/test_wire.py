"""One bounded HTTP request (quaero/sampling/wire.py): a request and its reply round trip, and each way a
server fails to answer ends as its own error within its bound (the server sampler over it:
test_sampler_server_faults.py)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from quaero.sampling import wire


def test_a_request_and_its_reply_round_trip(http_server):
    seen = []

    def echo(method, path, body):
        seen.append((method, path))
        return 201, {"got": json.loads(body or b"null"), "path": path}

    url = http_server(echo)
    body = json.dumps({"prompt": [1, 2, 3], "text": "é"}).encode()
    status, reply = wire.exchange("POST", f"{url}/v1/completions?x=1", body)
    assert status == 201 and json.loads(reply) == {"got": {"prompt": [1, 2, 3], "text": "é"},
                                                   "path": "/v1/completions?x=1"}
    assert wire.exchange("GET", f"{url}/health")[0] == 201 and seen[-1] == ("GET", "/health")


def test_a_dropped_connection_is_a_connection_error(http_server):
    with pytest.raises(ConnectionResetError, match="closed without a reply"):
        wire.exchange("GET", f"{http_server(lambda *_: None)}/health")


def _silent(conn, done):
    with conn:
        done.wait(30)


def test_a_silent_server_ends_at_the_first_byte_bound_and_an_abort_at_once(raw_server):
    url = raw_server(_silent)
    t0 = time.monotonic()
    with pytest.raises(wire.ReplyTimeout, match=r"no reply within 0.5s \(\[sampler\] request_timeout_s\)"):
        wire.exchange("GET", f"{url}/health", first_byte_s=0.5)
    assert time.monotonic() - t0 < 3
    abort = threading.Event()
    threading.Timer(0.3, abort.set).start()
    with pytest.raises(KeyboardInterrupt):
        wire.exchange("GET", f"{url}/health", abort=abort)
    assert time.monotonic() - t0 < 6
