"""Shared test setup: offline hub, one model cache for the session, the real tiny-qwen3 and tokenizer, and the
local stand-ins for a misconfigured, flaky or hostile vLLM server."""
import json
import os
import sys
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("QUAERO_CACHE", os.path.join(tempfile.gettempdir(), "quaero-test-cache"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Each xdist worker takes its share of the cores for torch's threads, set before torch is imported so its
# OpenMP pool and the runs the tests start as subprocesses have it. With torch's default (a thread per core in
# every worker) a worker's waiting threads spin (OpenMP's active wait) on the cores the other worker computes
# on: three runs of examples/custom_loss side by side on 2 cores took 82 s each with the default threads, 37 s
# with one each (README "Tests"). A count set by the user is kept.
if (workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT")) and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // int(workers)))
    if "torch" in sys.modules:  # a plugin imported it first: its pool is sized already
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
import pytest


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The embedded default model folder (built once per cache)."""
    from quaero.models.cache import materialize_named

    return materialize_named("tiny-qwen3")


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory):
    """A random Qwen3 with vocab 512 (tests/fixtures/small_model.py), for trainer and benchmark tests."""
    from fixtures.small_model import save_small_model

    return save_small_model(tmp_path_factory.mktemp("small-qwen3"))


@pytest.fixture(scope="session")
def tiny_smollm2_dir():
    """tiny-smollm2 (the second family: Llama, SmolLM2's tokenizer and template), built once; skips where the
    SmolLM2 files are not installed (a failure in CI)."""
    from fixtures import require_smollm2

    from quaero.models.load import resolve_model

    require_smollm2()
    return resolve_model("tiny-smollm2")


@pytest.fixture(scope="session")
def qwen3_tokenizer(tiny_model_dir):
    from quaero.models.load import load_tokenizer

    return load_tokenizer("tiny-qwen3")


@pytest.fixture(autouse=True)
def _logging_as_a_new_process_has_it():
    """Each test starts with the console logging a fresh process has: a run earlier in the same worker
    (`[logging] console = "none"`) must not silence the lines a later test reads (pytest -n 2 --dist loadfile
    puts files in a different order each time)."""
    from quaero.telemetry import runlog

    runlog.configure()  # what get_logger() does on a new process's first call
    yield


@pytest.fixture(autouse=True)
def _malloc_as_a_new_process_has_it():
    """A trainer built in this process from a config with `train_cpu_malloc_cache = true`
    (envs/toolbench.toml) keeps malloc's freed memory for the rest of the process: a later test in the same
    worker would read resident memory that never grows (a 512 MiB tensor served from the kept heap). Undone
    after each test."""
    yield
    from trainers import memory

    memory.release_cpu_malloc_cache()


@pytest.fixture(autouse=True)
def _auto_samples_with_hf_unless_the_test_is_marked_vllm(request, monkeypatch):
    """A test not marked `vllm` runs in this process as it would on a machine without vLLM: `[sampler] backend
    = "auto"` picks hf. Else the same test took another engine's code path in CI than on a machine without
    vLLM, and paid a vLLM engine start (~20 s on 2 CPU cores) for a run that was not about sampling. A test
    that samples with vLLM says so (`pytest.mark.vllm`, or `backend = "vllm"` in its config, which this leaves
    alone: only `auto`'s choice changes); a `quaero` subprocess is not reached by this."""
    if request.node.get_closest_marker("vllm") is None:
        from quaero import sampler_registry, sampling

        chosen = sampling.resolve_backend
        monkeypatch.setattr(sampling, "resolve_backend", lambda name, device: sampler_registry.FALLBACK
                            if name == sampler_registry.AUTO else chosen(name, device))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (QUAERO_REQUIRE_ENGINES=1) a vllm/unsloth-tier test that skips is a failure: the engine
    was supposed to be installed, so a skip would hide a broken tier. Likewise a peers-tier test under
    QUAERO_REQUIRE_PEERS=1 (CI's own venv with the [peers] extra)."""
    outcome = yield
    report = outcome.get_result()
    engines = ("vllm", "unsloth", "smollm2", "gemma3")
    required = (engines if os.environ.get("QUAERO_REQUIRE_ENGINES") == "1" else ()) + (
        ("peers",) if os.environ.get("QUAERO_REQUIRE_PEERS") == "1" else ())
    # (an expected failure, `xfail`, reports as skipped too: it is a tracked defect, not a missing engine)
    tier = any(item.get_closest_marker(m) for m in required)
    if report.skipped and not hasattr(report, "wasxfail") and tier:
        report.outcome = "failed"
        report.longrepr = f"engine tier skipped in CI: {report.longrepr}"


# --- environments (quaero.openenv_client, envs/toolbench) ---------------------------------------------------
@pytest.fixture(scope="session")
def toolbench_url():
    """A toolbench server started with the real `quaero env serve` CLI on 127.0.0.1 (killed by pid)."""
    from fixtures import served

    with served("envs.toolbench:ToolBenchEnv", max_concurrent_envs=16) as (url, _proc):
        yield url


@pytest.fixture(scope="session")
def guess_url():
    """The test-only plain env (tests/fixtures/guess.py), served by `quaero env serve`."""
    from fixtures import served

    with served("fixtures.guess:GuessEnv", max_concurrent_envs=8) as (url, _proc):
        yield url


# --- samplers (quaero.sampling) ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """One vLLM engine on tiny-qwen3 for the session (the CPU build in CI); skips where vLLM is absent."""
    from fixtures import require_vllm

    require_vllm()
    from quaero.sampling.vllm import make_engine

    # in a child process: an in-process engine would hold a process group of its own in the test process for
    # the whole session, and a test of the launcher's group would read its world size (the in-process engine
    # is what quaero train builds; test_train_e2e, test_train_ahead and test_bench build it)
    llm = make_engine(str(tiny_model_dir), dtype="float32", max_model_len=4096, max_num_seqs=16,
                      in_process=False)
    yield llm
    del llm


# --- trainer backends (trainers/) ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def local_smoke_metrics(tiny_model_dir):
    """One `local` RL + ECHO step on tiny-qwen3 over the sparse smoke rows (benchmarks/smoke.py), once."""
    from benchmarks.smoke import run

    return run("local")


# --- rollout (quaero.rollout.render, quaero.rollout.driver)
# --------------------------------------------------------
@pytest.fixture(scope="session")
def qwen3_render(qwen3_tokenizer):
    """RenderAdapter: the real Qwen3 renderer (renderers 0.1.7, thinking on) over the offline Qwen
    tokenizer."""
    from quaero.config import ModelConfig
    from quaero.rollout.render import RenderAdapter

    return RenderAdapter(qwen3_tokenizer, ModelConfig())


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir):
    """tiny-qwen3 as a transformers module in eval mode (the rollout tests' policy and log-prob reference)."""
    from quaero.models.load import load_causal_lm

    return load_causal_lm("tiny-qwen3").eval()


@pytest.fixture(scope="session")
def tiny_hf_sampler(tiny_lm):
    """HFSampler over tiny_lm: temperature 1, 8 tokens max (a random model: completions truncate)."""
    from quaero.config import SamplerConfig
    from quaero.sampling.hf import HFSampler

    return HFSampler(tiny_lm, SamplerConfig(max_tokens=8, temperature=1.0), stop_token_ids=[151645, 151643])


@pytest.fixture
def http_server():
    """serve(replies) -> url of a local HTTP server: a stand-in for a misconfigured, foreign or flaky server
    (the fault under test). `replies` is {path: (status, JSON-able body or raw bytes)} for GETs (the others
    404), or a function (method, path, body bytes) -> (status, body), or None to drop the connection."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    servers = []

    def serve(replies) -> str:
        def respond(method, path, body):
            if callable(replies):
                return replies(method, path, body)
            return replies.get(path, (404, b"<html>Not Found</html>")) if method == "GET" else (404, b"")

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, method):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                reply = respond(method, self.path, body)
                if reply is None:
                    self.close_connection = True  # no status line: the client sees the connection drop
                    return
                status, payload = reply
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()


@pytest.fixture
def raw_server():
    """serve(talk) -> url of a local TCP server whose every connection is handed to `talk(conn, done)`: a
    server that never answers or trickles its reply (the fault under test). `done` is set at teardown."""
    import socket
    import threading

    done, listeners = threading.Event(), []

    def serve(talk) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.settimeout(0.2)
        listeners.append(listener)

        def accept():
            while not done.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                threading.Thread(target=talk, args=(conn, done), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}"

    yield serve
    done.set()
    for listener in listeners:
        listener.close()
