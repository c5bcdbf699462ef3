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

from quaero.telemetry import names
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
            log.info(names.SAVE_ON_CPU_NOOP_EVENT, device=str(device),
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


# Linux resets a process's peak RSS (VmHWM, and getrusage's ru_maxrss with it) on "5" written here, so a CPU
# run can read each phase's own peak as CUDA does with reset_peak_memory_stats (proc(5), clear_refs)
_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"
_rss_resets = sys.platform.startswith("linux")  # until a write is refused (a sandbox may forbid it)
_folded_mb: dict[str, float] = {}  # per device type: the process's peak before the last reset


def reset_peak(device: torch.device | str) -> None:
    """Open a window: `peak_mem_mb` reads the peak since here (`process_peak_mb` keeps the process's)."""
    global _rss_resets
    kind = torch.device(device).type
    _folded_mb[kind] = process_peak_mb(device)
    if kind == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif _rss_resets:
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
        except OSError:
            _rss_resets = False


def _vm_hwm_mb() -> float | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_mem_mb(device: torch.device | str) -> tuple[float, str]:
    """(peak MB, source) since `reset_peak`: the CUDA allocator's peak (`cuda_max_allocated`), else the
    process's peak RSS since the reset on Linux (`rss_since_reset`), else the process's peak RSS since it
    started (`process_peak_rss`: no reset where the kernel has none)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    if _rss_resets and torch.device(device).type in _folded_mb and (hwm := _vm_hwm_mb()) is not None:
        return hwm, "rss_since_reset"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "process_peak_rss"


def process_peak_mb(device: torch.device | str) -> float:
    """The peak since the process started (CUDA: the allocator's), whatever windows `reset_peak` opened."""
    return max(_folded_mb.get(torch.device(device).type, 0.0), peak_mem_mb(device)[0])


@contextlib.contextmanager
def peak_window(device: torch.device | str, out: dict, key: str):
    """`out[key]` = the peak MB of the block (`reset_peak` ... `peak_mem_mb`), rounded to 0.1."""
    reset_peak(device)
    try:
        yield
    finally:
        out[key] = round(peak_mem_mb(device)[0], 1)
