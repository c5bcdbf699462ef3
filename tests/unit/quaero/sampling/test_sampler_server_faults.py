"""A hostile or broken vLLM server (`[sampler] urls`): every wait on it is bounded and a stop request ends it;
every reply is checked at the boundary, a bad one a one-line ServerError. The servers are local stand-ins
(tests/conftest.py `http_server`, `raw_server`); the sampler and its HTTP client are quaero's own."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest

from quaero.config import SamplerConfig
from quaero.sampling import wire
from quaero.sampling.server import ServerError, VLLMServerSampler, server_problem

pytestmark = pytest.mark.hostile

PROMPT = [151644, 872]
GOOD = {"index": 0, "token_ids": [9707, 151645], "logprobs": {"token_logprobs": [-0.5, -0.25]}}


def _sampler(url: str, request_timeout_s: float = 900.0, stop_grace_s: float = 10.0,
             **kw) -> VLLMServerSampler:
    cfg = SamplerConfig(mode="server", max_tokens=8, request_timeout_s=request_timeout_s,
                        stop_grace_s=stop_grace_s)
    return VLLMServerSampler([url], cfg, stop_token_ids=[151645], on_cpu=True, **kw)


def _silent(conn, done):
    """Reads the request, then never answers (until teardown)."""
    conn.recv(65536)
    done.wait()
    conn.close()


def _trickle(conn, done):
    """Answers one byte every 0.1 s, forever."""
    conn.recv(65536)
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b" " * 100000
    for byte in reply:
        if done.wait(0.1):
            break
        try:
            conn.send(bytes([byte]))
        except OSError:
            break
    conn.close()


@pytest.mark.parametrize("talk, bound, match", [
    (_silent, {}, r"timed out \(no reply within 0.5s \(\[sampler\] request_timeout_s\)\)"),
    (_trickle, {"REPLY_TIMEOUT_S": 0.5}, (r"timed out \(a reply still incomplete 0.5s after its first byte "
                                         r"\(\d+ bytes")),
])
def test_a_server_that_never_answers_or_trickles_is_a_bounded_wait(monkeypatch, raw_server, talk, bound,
                                                                   match):
    """The first byte's bound is `[sampler] request_timeout_s` (it was an hour, fixed in the code)."""
    for name, value in bound.items():
        monkeypatch.setattr(wire, name, value)
    monkeypatch.setattr(wire, "POLL_S", 0.05)
    url = raw_server(talk)
    t0 = time.monotonic()
    with pytest.raises(ServerError, match=rf"^vLLM server {url}/v1/completions {match}[^\n]*$"):
        _sampler(url, request_timeout_s=0.5).generate([PROMPT], seed=1)
    assert time.monotonic() - t0 < 5  # a bound that ran out is not sent again


def test_a_server_that_accepts_no_connection_is_a_bounded_wait(monkeypatch):
    """An address that drops packets: the connect's own bound (the fault: a connect that times out)."""
    def unanswered(address, timeout):
        assert timeout == wire.CONNECT_TIMEOUT_S
        raise TimeoutError("timed out")

    monkeypatch.setattr(wire.socket, "create_connection", unanswered)
    url = "http://192.0.2.1:8000"
    with pytest.raises(ServerError, match=rf"^vLLM server {re.escape(url)}/reset_prefix_cache timed out \(no "
                                          rf"connection within 10s\)$"):
        _sampler(url)._post(url, "/reset_prefix_cache", None, retry=True)  # a bound that ran out: not retried


def test_sigterm_ends_a_wait_on_a_silent_server(monkeypatch, raw_server):
    """The stop request of `quaero train` (quaero/recipe/stop.py StopRequest, a real SIGTERM to this
    process): the wait goes on for [sampler] stop_grace_s, then ends as an interrupted run (the CLI exits
    130), not after the timeout."""
    from quaero.recipe.stop import StopRequest

    monkeypatch.setattr(wire, "POLL_S", 0.05)
    url = raw_server(_silent)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    t0 = time.monotonic()
    with StopRequest() as stop, pytest.raises(KeyboardInterrupt):
        _sampler(url, stop_grace_s=0.3).generate([PROMPT, PROMPT], seed=1)
    assert stop.requested and time.monotonic() - t0 < 5
    assert not wire.STOP_REQUESTED.is_set()  # the next run starts without a stop request


def test_an_interrupted_caller_ends_the_requests_in_flight(monkeypatch, raw_server):
    """Ctrl-C outside a training step (a KeyboardInterrupt in the waiting thread): the worker threads stop at
    their next poll, so the process exits instead of waiting out FIRST_BYTE_TIMEOUT_S."""
    monkeypatch.setattr(wire, "POLL_S", 0.05)
    url = raw_server(_silent)
    sampler = _sampler(url)
    threading.Timer(0.3, sampler._abort.set).start()  # what _in_parallel does on an interrupt
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        sampler._post(url, "/v1/completions", {})
    assert time.monotonic() - t0 < 5


def _choice(**changes) -> dict:
    return {**GOOD, **changes}


@pytest.mark.parametrize("body, match", [
    (b"<html>502 Bad Gateway</html>", r"replied with a body that is not JSON: b'<html>502"),
    (b"[1, 2]", r"replied with a JSON list, not an object"),
    ({"id": "x"}, r"replied without a list of choices"),
    ({"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}}]}, (r"1 choices indexed \[-1\] "
                                                                                r"for n=1")),
    ({"choices": [_choice(index=1)]}, r"choices indexed \[1\] for n=1"),
    (b'{"choices": [{"index": 0, "token_ids": [1], "logprobs": {"token_logprobs": [NaN]}}]}', (r"log-prob "
                                                                                              r"nan")),
    (b'{"choices": [{"index": 0, "token_ids": [1], "logprobs": {"token_logprobs": [Infinity]}}]}',
     r"log-prob inf"),
    ({"choices": [_choice(logprobs={"token_logprobs": ["-0.5", -0.25]})]}, r"log-prob -0.5 \(finite numbers"),
    ({"choices": [_choice(logprobs={"token_logprobs": [None, -0.25]})]}, r"log-prob None"),
    ({"choices": [_choice(logprobs=None)]}, r"a choice without token_ids and logprobs.token_logprobs lists"),
    ({"choices": [_choice(logprobs={"token_logprobs": [-0.5]})]}, r"2 token ids and 1 log-probs"),
    ({"choices": [_choice(token_ids=[1_000_000_000, 151645])]}, (r"token id 1000000000 \(token ids are "
                                                                r"integers in 0\.\.151936\)")),
    ({"choices": [_choice(token_ids=[-5, 151645])]}, r"token id -5"),
    ({"choices": [_choice(token_ids=[9707.7, 151645])]}, r"token id 9707.7"),
    ({"choices": [_choice(token_ids=[True, 151645])]}, r"token id True"),
    ({"choices": [_choice(token_ids=[7] * 20001, logprobs={"token_logprobs": [-1.0] * 20001})]},
     r"20001 tokens for max_tokens=8"),
])
def test_a_bad_completion_reply_is_one_server_error(http_server, body, match):
    url = http_server(lambda method, path, data: (200, body))
    with pytest.raises(ServerError) as e:
        _sampler(url, vocab_size=151936).generate([PROMPT], seed=1)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"vLLM server {url}/v1/completions replied"), message
    assert re.search(match, message), message


def test_a_good_reply_passes_the_checks(http_server):
    url = http_server(lambda method, path, data: (200, {"choices": [GOOD]}))
    (c,), = _sampler(url, vocab_size=151936).generate([PROMPT], seed=1)
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([9707, 151645], [-0.5, -0.25], "stop")


@pytest.mark.parametrize("held", ["abc", [4096], None, 4096.0])
def test_a_max_model_len_that_is_not_a_number_is_named(http_server, held):
    from fixtures.runs import ROOT

    recorded = json.loads((ROOT / "tests" / "fixtures" / "vllm_server_info.json").read_text())
    recorded["server_info"]["vllm_config"]["model_config"]["max_model_len"] = held
    url = http_server({"/v1/models": (200, recorded["models"]),
                       "/server_info?config_format=json": (200, recorded["server_info"])})
    found = server_problem(url, SamplerConfig(mode="server"), max_seq_len=4096)
    assert found == (f"reports max_model_len={str(held)!r} in GET /server_info, not a number of tokens: name "
                     "a `vllm serve` server started with --max-model-len 4096")


def test_a_server_info_with_sections_of_the_wrong_shape_is_a_problem_not_a_crash(http_server):
    url = http_server({"/v1/models": (200, {"data": [{"owned_by": "vllm"}]}),
                       "/server_info?config_format=json": (200, {"vllm_config": {"model_config": [1, 2]}})})
    found = server_problem(url, SamplerConfig(mode="server"), max_seq_len=4096)
    assert found is not None and "log-probs as None" in found


def test_the_bounded_client_reads_a_real_uvicorn_server(toolbench_url):
    """quaero's own HTTP client against a real ASGI server (uvicorn, as `vllm serve` runs): GET and POST
    replies read whole with `Connection: close`, and an error status comes back as such."""
    status, body = wire.exchange("GET", toolbench_url.replace("ws://", "http://") + "/health")
    assert status == 200 and json.loads(body)
    status, body = wire.exchange("POST", toolbench_url.replace("ws://", "http://") + "/reset", b"{}")
    assert status == 200 and "observation" in json.loads(body)
    status, _ = wire.exchange("GET", toolbench_url.replace("ws://", "http://") + "/no-such-route")
    assert status == 404


def test_a_probe_of_a_silent_or_trickling_server_fails_the_check_in_seconds(monkeypatch, raw_server):
    """`quaero check` asks a [sampler] urls server what it is: one that never answers, or trickles, is "does
    not answer" within PROBE_TIMEOUT_S, not an hour."""
    from quaero.sampling import server as server_mod

    monkeypatch.setattr(server_mod, "PROBE_TIMEOUT_S", 0.4)
    monkeypatch.setattr(wire, "POLL_S", 0.05)
    for talk, why in ((_silent, "no reply within 0.4s"),
                      (_trickle, "a reply still incomplete 0.4s after its first")):
        url = raw_server(talk)
        t0 = time.monotonic()
        found = server_problem(url, SamplerConfig(mode="server"), max_seq_len=4096)
        assert found.startswith(f"does not answer ({why}") and found.endswith("start it or fix the address")
        assert time.monotonic() - t0 < 3
