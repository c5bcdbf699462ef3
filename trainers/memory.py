"""Memory controls and readings: saved-tensor CPU offload (`train_save_on_cpu`), the CPU allocator's mmap
threshold (`train_cpu_mmap_threshold`) or its cache (`train_cpu_malloc_cache`), and step peak memory.

`saved_tensors_offload` wraps a microbatch's forward: every tensor autograd saves for backward (with
at least `min_numel` elements) is moved to host memory when saved and back when backward needs it.
Exact (a copy, not an approximation), slow (a transfer per saved tensor), for full-context rows that
would not fit otherwise. On a CPU device there is nothing to offload: a logged no-op.
"""
from __future__ import annotations

import contextlib
import ctypes
import platform
import resource
import sys
import time

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


# glibc's mallopt parameters: allocations at least this large are mmapped, and unmapped when freed; the most
# blocks mmapped at once (0: none, every block from malloc's heaps); free memory at the heap's top above this
# many bytes is given back to the system
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_TRIM_THRESHOLD = -1
_mmap_threshold: int | None = None  # what `fix_cpu_mmap_threshold` set in this process (None: nothing)
_malloc_cache = False  # whether `keep_cpu_malloc_cache` set it in this process


def _glibc_function(name: str):
    """glibc's function `name` in this process, or None (another libc, or a glibc without it)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def _mallopt(device: torch.device | str, *settings: tuple[int, int]) -> bool:
    """glibc's mallopt(param, value) for each setting, on a CPU device; False where it cannot run (another
    device, another libc) or glibc refused a setting."""
    if torch.device(device).type != "cpu" or (mallopt := _glibc_function("mallopt")) is None:
        return False
    return all(mallopt(param, ctypes.c_int(value)) == 1 for param, value in settings)


def keep_cpu_malloc_cache(device: torch.device | str, keep: bool) -> bool:
    """On a CPU device with glibc and `keep`, malloc keeps what a step frees for the next step to reuse: no
    block is mmapped and the heap is never trimmed, as CUDA's caching allocator keeps freed blocks. Whether it
    is in force in this process.

    Without it every tensor of 32 MiB or more (glibc's largest mmap threshold) is mmapped when allocated and
    unmapped when freed, and each of its pages faults in zeroed on first touch, every step: the LM head's
    `[rows, vocab]` logits and gradients, a tied embedding's gradient, the optimizer's temporaries.
    Measured on the tiny main job's warm start (40 steps, 2 CPU cores, hf sampler, twice each): step mean
    0.89-1.00 s -> 0.55-0.64 s, system time 24 s -> 3 s, peak RSS 1.08 -> 1.59 GB. The process keeps its
    largest step's memory plus the heap's fragments: leave it off for a large model (the SmolLM2-135M RL
    step kept 9.7 GiB under glibc's dynamic threshold, `fix_cpu_mmap_threshold`). Process-wide, as that
    is. A freed block is reused only while nothing long-lived lands among the freed blocks: a thread left
    per call (each one's state allocated by the caller, quaero/bounded.py before its fix) pinned them, and
    the heap grew by whole blocks every few steps (`quaero bench soak --probe 300 --leak-threads`: 0.44 ->
    1.18 GiB by step 50; without the leak 0.66 flat); `quaero review` flags such growth."""
    global _malloc_cache
    if keep and _mallopt(device, (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)):
        _malloc_cache = True
    return _malloc_cache


def release_cpu_malloc_cache() -> None:
    """Undo `keep_cpu_malloc_cache` in this process, for one that runs trainers one after another (a
    notebook, a test session): blocks of 128 KiB and more are mmapped again, the heap is trimmed above 128 KiB
    (both now fixed, as `fix_cpu_mmap_threshold` leaves them) and its free memory goes back (malloc_trim)."""
    global _malloc_cache
    if _malloc_cache and _mallopt("cpu", (M_MMAP_MAX, 65536), (M_TRIM_THRESHOLD, 128 * 1024)):
        ctypes.CDLL(None).malloc_trim(0)
        _malloc_cache = False


def fix_cpu_mmap_threshold(device: torch.device | str, threshold: int) -> int | None:
    """On a CPU device with glibc, fix malloc's mmap threshold at `threshold` bytes (0: leave it); the
    threshold now in force (None where nothing was set: another device, another libc, or 0).

    torch's CPU tensors come from malloc. glibc starts by mmapping blocks of 128 KiB and more (freed:
    unmapped, back to the system) but raises that threshold to the size of each mmapped block freed, up to
    32 MiB, so after the first step an activation of a few MiB (a 2,048-token row at hidden 576 or
    intermediate 1,536: 4.5-12 MiB) comes from malloc's heaps, and what a microbatch's backward frees there
    is kept by the process.
    Measured on an RL step of SmolLM2-135M (LoRA, float32, 3 microbatches of one 1,900-token row): torch's
    allocator peaked 2.27 GiB above the resident 0.56 (the plan of that microbatch: 2.85 GiB) while the
    process's RSS grew to 9.7 GiB and stayed there (without the profiler: killed for memory); with the
    threshold fixed at 128 KiB the same step peaked at 3.4 GiB RSS and left 1.2 (benchmarks/README.md, "The
    RL step's memory, found"). A fixed threshold also stops glibc's dynamic trim threshold. Process-wide:
    an in-process vLLM engine or `hf` sampler gets it too."""
    global _mmap_threshold
    if threshold > 0 and _mallopt(device, (M_MMAP_THRESHOLD, threshold)):
        _mmap_threshold = threshold
    return _mmap_threshold


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


def _status_mb(field: str) -> float | None:
    """A memory field of /proc/self/status (`VmHWM`, `VmRSS`) in MiB; None where there is none."""
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 2**10
    except (OSError, ValueError, IndexError):
        pass
    return None


def _vm_hwm_mb() -> float | None:
    return _status_mb("VmHWM")


def process_rss_mb() -> float | None:
    """The process's resident memory now (MiB; host RAM whatever the device), None off Linux: what a run's
    steps log so that a process that keeps growing shows (`quaero review`'s "process memory flat")."""
    rss = _status_mb("VmRSS")
    return None if rss is None else round(rss, 1)


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (2.33+): every field a size_t, summed over all of malloc's arenas."""
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                      "usmblks", "fsmblks", "uordblks", "fordblks",
                                                      "keepcost")]


def _mallinfo2():
    """glibc's mallinfo2 function, or None (another libc, or a glibc before 2.33)."""
    if (fn := _glibc_function("mallinfo2")) is not None:
        fn.restype = _MallInfo2
    return fn


_MALLINFO2 = _mallinfo2()
MALLINFO_READABLE = _MALLINFO2 is not None
# mallinfo2 walks every free block of every arena: ~20 ms in the tiny main job's warm start (2 s steps),
# ~0.1 s in a heap of 100,000 free blocks. A step skips the reading while its last cost is above this share of
# the step's time; each skip halves that cost, so a reading is tried again a few steps later.
MALLINFO_STEP_SHARE = 0.01
_mallinfo_cost_s = 0.0


def malloc_in_use_mb(step_s: float | None = None) -> float | None:
    """What malloc has handed out and not had back (MiB): its heaps' blocks in use (`uordblks`) and its
    mmapped blocks (`hblkhd`), from glibc's mallinfo2; None without it. Beside `process_rss_mb`: RSS that
    grows while this stays flat is memory the allocator keeps after it was freed (its cache, the fragments
    between blocks still in use), not objects the process still holds. It counts what malloc serves: torch's
    CPU tensors, C extensions' buffers, Python's objects over 512 bytes; not memory mapped from files (a
    model's weights read by mmap) nor Python's small-object arenas. With `step_s` (the step's seconds): None
    while the last reading cost more than MALLINFO_STEP_SHARE of it."""
    global _mallinfo_cost_s
    if _MALLINFO2 is None:
        return None
    if step_s is not None and _mallinfo_cost_s > MALLINFO_STEP_SHARE * step_s:
        _mallinfo_cost_s /= 2
        return None
    t0 = time.perf_counter()
    info = _MALLINFO2()
    _mallinfo_cost_s = time.perf_counter() - t0
    return round((info.uordblks + info.hblkhd) / 2**20, 1)


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
