"""Memory controls and readings: saved-tensor CPU offload (`train_save_on_cpu`) and step peak memory.

`saved_tensors_offload` wraps a microbatch's forward: every tensor autograd saves for backward (with
at least `min_numel` elements) is moved to host memory when saved and back when backward needs it.
Exact (a copy, not an approximation), slow (a transfer per saved tensor), for full-context rows that
would not fit otherwise. On a CPU device there is nothing to offload: a logged no-op.
"""
from __future__ import annotations

import contextlib
import resource
import sys

import torch

from quaero.telemetry.runlog import get_logger

log = get_logger(__name__)
_noted_cpu_noop = False


class OffloadStats:
    def __init__(self) -> None:
        self.tensors = 0
        self.bytes = 0


def saved_tensors_offload(device: torch.device | str, *, enabled: bool, pin_memory: bool, min_numel: int,
                          stats: OffloadStats | None = None):
    """A context manager for one microbatch's forward (see module docstring)."""
    global _noted_cpu_noop
    device = torch.device(device)
    if not enabled:
        return contextlib.nullcontext()
    if device.type != "cuda":
        if not _noted_cpu_noop:
            log.info("save_on_cpu_noop", device=str(device),
                     note="train_save_on_cpu offloads accelerator memory; on a CPU device it does nothing")
            _noted_cpu_noop = True
        return contextlib.nullcontext()
    stats = stats if stats is not None else OffloadStats()

    def pack(t: torch.Tensor):
        if t.device.type != "cuda" or t.numel() < min_numel:
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin_memory)
        host.copy_(t, non_blocking=pin_memory)
        stats.tensors += 1
        stats.bytes += t.numel() * t.element_size()
        return (t.device, host)

    def unpack(packed):
        if isinstance(packed, tuple):
            dev, host = packed
            return host.to(dev, non_blocking=pin_memory)
        return packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def reset_peak(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mem_mb(device: torch.device | str) -> tuple[float, str]:
    """(peak MB, source): the CUDA allocator's peak since `reset_peak`, else the process's peak RSS."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "process_peak_rss"
