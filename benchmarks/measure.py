"""The LM-head benchmarks' harness (`quaero bench echo`, `step`, `crossover`): their command line, the machine
fields their JSON starts with, and the time and peak memory of a region, the same way on every device.

Peak memory is the region's *own* allocations: the highest net number of bytes allocated above
what was allocated when the region started (inputs and weights that exist before it do not count).

- CUDA: the trainer's own peak reading (trainers/memory.py: `reset_peak`, then `peak_mem_mb`, the
  allocator's `max_memory_allocated`) less `memory_allocated()` at the start (reserved likewise), read in
  the same runs that are timed.
- CPU: torch's CPU allocator reports every allocation and free to the profiler when
  `torch.profiler.profile(profile_memory=True)` is on. We replay those `[memory]` events in time
  order and take the highest running total. This counts every tensor, autograd buffer, gradient and
  optimizer state the region allocates, exactly, without RSS noise or allocator reuse hiding
  anything; it does not see memory that bypasses torch's allocator (e.g. oneDNN scratch, Python
  objects), which is small here. The profiler slows ops down, so memory runs are separate from the
  timed runs.

Every figure is a median over repeats after a warm-up run (first-call costs excluded).
On CUDA the peak is read per timing sample; a sample of several calls reports their joint peak.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from trainers.memory import peak_mem_mb, reset_peak

MIB = 2**20


class BenchValueError(RuntimeError):
    """A benchmark region whose values disagree with the reference: an error, never a figure."""


def run_cli(build_parser: Callable[[], Any], run: Callable[[Any], dict[str, Any]], argv: list[str], *,
            verdict: Callable[[dict[str, Any]], str | None] | None = None) -> int:
    """A benchmark's `main`: parse `argv`, run under `--threads`, print the JSON document (and write it to
    `--json PATH`). Exit 1 without a document when a value check fails (`BenchValueError`), and after it when
    `verdict(doc)` names a problem (a proof that did not hold)."""
    args = build_parser().parse_args(argv)
    from quaero.tools.outputs import bench_output

    bench_output(args.json)  # a path it cannot write is refused before the work, not after
    try:
        with torch_threads(args.threads):
            doc = run(args)
    except BenchValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    emit(doc, args.json)
    problem = verdict(doc) if verdict else None
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0


def available_bytes(device: torch.device) -> int:
    """Memory a benchmark may still take on `device`: CUDA's free bytes, else the host's MemAvailable."""
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks cached from earlier probes are available too
        free, _ = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62
CPU_MEMORY_METHOD = ("cpu: torch.profiler(profile_memory=True) CPU-allocator events replayed in order; "
                     "peak net bytes allocated above the region's start (runs separate from timing)")
CUDA_MEMORY_METHOD = ("cuda: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), "
                      "minus memory_allocated() at the region's start")


def memory_method(device: torch.device) -> str:
    return CUDA_MEMORY_METHOD if device.type == "cuda" else CPU_MEMORY_METHOD


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 (C++ logging included) for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def cpu_peak_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """Run `fn` under the profiler; return its result and the peak net CPU-allocator bytes."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
    with _quiet_stderr():  # kineto prints a line on every start and stop
        prof.start()
    try:
        result = fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == cpu]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return result, peak


@contextlib.contextmanager
def torch_threads(n: int | None):
    """`torch.set_num_threads(n)` for the duration (None: leave as is)."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _mb(nbytes: float) -> float:
    return round(nbytes / MIB, 3)


def _calibrate(fn: Callable[[], Any], before: Callable[[], None], device: torch.device,
               min_sample_s: float, max_inner: int) -> int:
    """Calls per timing sample so that one sample lasts at least `min_sample_s` (as timeit does)."""
    before()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = max(time.perf_counter() - t0, 1e-7)
    return max(1, min(max_inner, int(min_sample_s / once) + 1))


def _sample(fn: Callable[[], Any], before: Callable[[], None], device: torch.device,
            inner: int) -> tuple[float, Any, int | None, int | None]:
    """Seconds per call (mean of `inner` calls), the last value, and CUDA peaks above the start."""
    before()
    sync(device)
    if device.type == "cuda":
        reset_peak(device)
        base_alloc, base_res = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    t0 = time.perf_counter()
    value = None
    for i in range(inner):
        if i:
            before()
        value = fn()
    sync(device)
    seconds = (time.perf_counter() - t0) / inner
    if device.type == "cuda":
        return (seconds, value, round(peak_mem_mb(device)[0] * MIB) - base_alloc,
                torch.cuda.max_memory_reserved(device) - base_res)
    return seconds, value, None, None


def measure_regions(fns: dict[str, Callable[[], Any]], device: torch.device, *, repeats: int,
                    warmup: int = 1, memory_repeats: int = 3, before: Callable[[], None] | None = None,
                    min_sample_s: float = 0.05, max_inner: int = 200) -> dict[str, dict[str, Any]]:
    """Median time and median peak memory of each region (forward + backward), measured fairly.

    Samples are interleaved (repeat r of every region, then repeat r + 1), so background load on a
    shared machine falls on all regions alike; a fast region's sample times several back-to-back
    calls (`inner_calls`, chosen once so a sample lasts >= `min_sample_s`). `before` runs ahead of
    every call (e.g. clearing `.grad`); its cost is negligible. Per region: median_s, min_s, max_s
    (seconds per call), samples_s (every sample, in the order taken: repeat r of two regions ran
    back to back, so their ratio pairs like with like), inner_calls, value (the last result),
    median_peak_allocated_mb and, on CUDA, median_peak_reserved_mb.
    """
    before = before or (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            before()
            fn()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    inner = {name: _calibrate(fn, before, device, min_sample_s, max_inner) for name, fn in fns.items()}
    times: dict[str, list[float]] = {name: [] for name in fns}
    peaks: dict[str, list[int]] = {name: [] for name in fns}
    reserved: dict[str, list[int]] = {name: [] for name in fns}
    values: dict[str, Any] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            seconds, values[name], peak, res = _sample(fn, before, device, inner[name])
            times[name].append(seconds)
            if peak is not None:
                peaks[name].append(peak)
                reserved[name].append(res)
    if device.type != "cuda":
        for _ in range(memory_repeats):
            for name, fn in fns.items():
                before()
                peaks[name].append(cpu_peak_bytes(fn)[1])
    out = {}
    for name in fns:
        out[name] = {"median_s": statistics.median(times[name]), "min_s": min(times[name]),
                     "max_s": max(times[name]), "samples_s": [round(t, 6) for t in times[name]],
                     "inner_calls": inner[name], "value": values[name],
                     "median_peak_allocated_mb": _mb(statistics.median(peaks[name]))}
        if reserved[name]:
            out[name]["median_peak_reserved_mb"] = _mb(statistics.median(reserved[name]))
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator rounded for a report; None when either side is missing or zero."""
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 3)


def load_average() -> list[float] | None:
    """The 1/5/15-minute load average (None where the OS has none): timings on a shared CPU move with it."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The machine fields every benchmark JSON starts with."""
    cuda = torch.cuda.is_available()
    return {
        "date": time.strftime("%Y-%m-%d"),
        "load_average_start": load_average(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_version": torch.__version__,
        "cuda_available": cuda,
        "cuda_device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu_threads": torch.get_num_threads(),
        "cpu_model": _cpu_model(),
        "memory_method": memory_method(device),
    }


def emit(doc: dict[str, Any], path: str | None) -> None:
    """Print the JSON document on stdout and, with `--json PATH`, write it there too."""
    text = json.dumps(doc, indent=2, sort_keys=True)
    print(text)
    if path:
        from quaero.tools.outputs import write_bench_output

        write_bench_output(path, text + "\n")  # never through a link, into a FIFO or over a run's file


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def resolve_bench_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available on this machine; use --device cpu")
    return device


def resolve_bench_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is float16 on CUDA (the precision long-row training runs at) and float32 on CPU."""
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
