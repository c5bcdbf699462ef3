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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from quaero import sampler_registry as registry

if TYPE_CHECKING:
    import torch

# vLLM's CPU engine reserves this many GiB for its KV cache; quaero sets it where the variable is unset
# (the engine in process and the `vllm serve` processes it starts), and `quaero check` counts it
CPU_KV_CACHE_ENV, CPU_KV_CACHE_GIB = "VLLM_CPU_KVCACHE_SPACE", 1


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
    # how update_weights reaches it: "copy" (hf), "file" (vLLM), "nccl" / "ipc" (servers)
    weight_transfer: str

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None: ...

    def close(self) -> None: ...


def request_seed(seed: int, prompt_index: int, n: int) -> int:
    """Seed of prompt i in a batched call, spaced by n: vLLM seeds the j-th of n samples with seed + j,
    so adjacent prompts with seeds seed and seed + 1 would repeat each other's samples."""
    return (seed * 1_000_003 + prompt_index) * max(n, 1)


def completion_budget(prompt_len: int, max_tokens: int, max_seq_len: int) -> int:
    """Tokens a completion of this prompt may have: `max_tokens`, capped by the context left after the
    prompt."""
    room = max_seq_len - prompt_len
    if room < 1:
        raise ValueError(f"a prompt of {prompt_len} tokens leaves no room under [model] "
                         f"max_seq_len={max_seq_len}; "
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
    session of their own), at the price of a server start per run (docs/scaling.md).
    """
    if name != registry.AUTO:
        return name
    if not registry.installed("vllm"):
        return registry.FALLBACK
    from quaero.process_group import launched_ranks

    return "vllm" if device.startswith("cuda") or launched_ranks() == 1 else registry.FALLBACK


def make_sampler(cfg, *, model=None, stop_token_ids: list[int], device: str, log_dir=None) -> Sampler:
    """The sampler `cfg.sampler.backend` and `mode` name, built by its engine's `build`
    (quaero/sampler_registry.py). `model` (the trainer's module) is shared by `hf` only; `log_dir` keeps the
    logs of the vLLM servers server mode starts (else temp files). `auto` promises a sampler that runs, not
    one engine at any price: when the engine it picked cannot start, it samples with `hf`, and says so."""
    from quaero.models.load import resolve_device

    device = resolve_device(device)
    sc = cfg.sampler
    if sc.mode != "colocated":  # the engine that serves the mode: the one named, or the first that runs it
        name = registry.serving(sc.mode)[0] if sc.backend == registry.AUTO else sc.backend
        return registry.builder(name, sc.mode)(cfg, model=model, stop_token_ids=stop_token_ids, device=device,
                                               log_dir=log_dir)
    name = resolve_backend(sc.backend, device)
    if name != registry.FALLBACK:
        try:
            return registry.builder(name)(cfg, model=model, stop_token_ids=stop_token_ids, device=device,
                                          log_dir=log_dir)
        except Exception as e:
            if sc.backend != registry.AUTO:
                raise
            from quaero.telemetry import names
            from quaero.telemetry.runlog import error_line, get_logger

            get_logger(__name__).warning(names.SAMPLER_FALLBACK_EVENT,
                                         chosen=registry.FALLBACK, error=error_line(e),
                                         note=f"[sampler] backend='auto' could not start {name} for this "
                                              f"model; sampling with {registry.FALLBACK} (backend={name!r} "
                                              "makes this an error)")
    return registry.builder(registry.FALLBACK)(cfg, model=model, stop_token_ids=stop_token_ids, device=device,
                                               log_dir=log_dir)
