"""`quaero bench step`: a whole train step on long rows, full-logits baseline vs the selective paths.

    quaero bench step --device cpu --seq-len 8192 --targets 64 --vocab-size 151936 --budget-gb 8

Each path is the `local` trainer's real `train_step` (one forward, RL + ECHO losses, one backward,
grad clipping, AdamW) configured as a user would configure it:
- `full_logits`: `train_selective_suffix_logits = false`: the model's full [L, V] logits ->
  log_softmax -> gather (the baseline every non-selective trainer pays);
- `selective_ce`: the eager exact path: selected hidden states -> LM head -> class-index CE;
- `chunked_recompute`: quaero's `train_logprob_chunk_size` path (recompute-in-backward, O(chunk x V));
- `chunked_all_positions`: the peers' method (prime-rl, verl, NeMo-RL): log-probs at every position,
  chunked with recompute in backward (`--peer-chunk-size`), masked by the loss (benchmarks/peers.py);
- `backbone_only`: the same step with no LM head at all, the floor every LM-head method sits above.
The model is a random-init Qwen3 with a real vocabulary (151,936) and a small hidden size, so that, as
in long-row training of real models, the vocabulary-sized LM-head region dominates memory.

Memory per step: `resident_mb` (parameters, buffers, AdamW state, measured when the step starts;
gradients are freed between steps) + `peak_step_mb` (the step's own peak allocations, see
measure.py) = `peak_total_mb`, after one warm-up step. `--budget-gb` finds, per path, the longest row
whose `peak_total_mb` fits, by probing lengths (a linear model of memory vs length picks the probes,
and no length predicted to exceed the machine's available memory is ever run). `--sweep` measures
`--sweep-paths` over a grid of row lengths x target densities, with each selective path's overhead
above `backbone_only`.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
from typing import Any

import torch

from benchmarks import peers
from benchmarks import trainstep as ts
from benchmarks.measure import (
    MIB,
    available_bytes,
    cpu_peak_bytes,
    environment,
    ratio,
    resolve_bench_device,
    resolve_bench_dtype,
    run_cli,
    sync,
)
from quaero.telemetry import names, proofs
from trainers.memory import peak_mem_mb, reset_peak

PATHS = {  # name -> trainer options
    "full_logits": {"selective": False},
    "selective_ce": {"selective": True},
    "chunked_recompute": {"selective": True, "chunk": True},
    "chunked_all_positions": {"selective": True, "peer": "chunked_all_positions"},
    "backbone_only": {"selective": True, "peer": "backbone_only"},
}
FLOOR = "backbone_only"
SWEEP_DEFAULTS = {  # device type -> (lengths, densities); a 32k step takes minutes on a CPU
    "cpu": ("2048,4096", "0.01,0.1,0.5"),
    "cuda": ("2048,4096,8192,16384,32768", "0.01,0.05,0.1,0.25,0.5"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quaero bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="model dtype; auto = float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--seq-len", type=int, default=8192, help="row length of the side-by-side comparison")
    p.add_argument("--targets", type=int, default=64, help="loss tokens per row (1/4 actions, 3/4 env)")
    p.add_argument("--turns", type=int, default=4, help="turns the targets are spread over")
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--peer-chunk-size", type=int, default=peers.DEFAULT_PEER_CHUNK,
                   help="chunk of the chunked_all_positions comparator (verl's default 512)")
    p.add_argument("--compile-selective-ce", default="off", choices=["off", "auto", "require"],
                   help="also run a compiled_ce path (CUDA)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per path (after one warm-up step)")
    p.add_argument("--interleave", action="store_true",
                   help="time the comparison's paths in turns (step r of each, then r + 1): fair under "
                        "background "
                        "load; every path's model stays resident")
    p.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of " + ",".join(PATHS))
    p.add_argument("--budget-gb", type=float, default=None, help="find the longest row each path fits")
    p.add_argument("--min-len", type=int, default=1024, help="budget search: shortest probe")
    p.add_argument("--max-len", type=int, default=32768, help="budget search: longest probe (search cap)")
    p.add_argument("--len-step", type=int, default=512, help="budget search: length granularity")
    p.add_argument("--mem-fraction", type=float, default=0.75,
                   help="never run a probe predicted to need more than this fraction of available memory")
    p.add_argument("--sweep", action="store_true", help="also measure --sweep-paths over lengths x densities")
    p.add_argument("--sweep-lengths", default=None, help="comma-separated row lengths (default: "
                   + "; ".join(f"{d} {v[0]}" for d, v in SWEEP_DEFAULTS.items()) + ")")
    p.add_argument("--sweep-densities", default=None, help="comma-separated targets / row length (default: "
                   + "; ".join(f"{d} {v[1]}" for d, v in SWEEP_DEFAULTS.items()) + ")")
    p.add_argument("--sweep-paths", default="selective_ce,chunked_all_positions,backbone_only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); 1 steadies timings on a busy shared machine")
    p.add_argument("--json", metavar="PATH")
    return p


class StepBench:
    def __init__(self, args, device: torch.device, dtype: torch.dtype) -> None:
        self.args, self.device = args, device
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.model_dir = ts.bench_model_dir(args.vocab_size, args.hidden_size, args.layers)
        self.probes: dict[tuple[str, int], dict[str, Any]] = {}
        self.cells: dict[tuple[str, int, int], dict[str, Any]] = {}
        self.live: dict[str, Any] = {}  # path -> trainer kept for interleaved timing
        self.layout = ""
        self.paths = dict(PATHS)
        if args.compile_selective_ce != "off":
            self.paths["compiled_ce"] = {"selective": True, "compile": args.compile_selective_ce}

    def trainer(self, path: str, seq_len: int):
        """A fresh `local` trainer for `path`; a peer's through the trainer's log-prob hook, its chunk as the
        selective policy's `chunk_size` (benchmarks/peers.py)."""
        opts = self.paths[path]
        peer = opts.get("peer")
        chunk = self.args.peer_chunk_size if peer else self.args.chunk_size if opts.get("chunk") else None
        spec = ts.bench_spec(self.model_dir, seq_len=seq_len, dtype=self.dtype_name,
                             selective=opts["selective"],
                             chunk_size=chunk, compile_mode=opts.get("compile", "off"), compile_min_tokens=1,
                             logprob_fn=peers.peer_logprob_fn(peer) if peer else "")
        return ts.make_trainer(spec, self.device)

    def rows(self, seq_len: int, targets: int | None = None):
        row, self.layout = ts.trace_row(seq_len, targets or self.args.targets, self.args.vocab_size,
                                        turns=self.args.turns, seed=self.args.seed)
        return [row]

    def resident_bytes(self, trainer) -> int:
        if self.device.type == "cuda" and not self.live:  # kept trainers would count in memory_allocated
            return torch.cuda.memory_allocated(self.device)
        seen, total = set(), 0
        tensors = list(trainer.model.parameters()) + list(trainer.model.buffers())
        for state in trainer.optimizer.state.values():
            tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
        for t in tensors + [p.grad for p in trainer.model.parameters() if p.grad is not None]:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def measure(self, path: str, seq_len: int, timed_steps: int = 0, targets: int | None = None,
                keep: bool = False) -> dict[str, Any]:
        """Warm-up step, one memory-measured step, then `timed_steps` timed steps, on a fresh trainer
        (kept in `self.live` with `keep`, for `interleaved`)."""
        # sweep cells (an explicit target count) are kept apart from the budget search's probes
        store, key = (self.probes, (path, seq_len)) if targets is None else (self.cells,
                                                                             (path, seq_len, targets))
        if not keep and key in store and store[key].get("steps", 0) >= timed_steps:
            return store[key]
        rows = self.rows(seq_len, targets)
        trainer = self.trainer(path, seq_len)
        trainer.train_step(rows)  # warm-up: AdamW state exists from here on
        gc.collect()
        resident = self.resident_bytes(trainer)
        train_step = trainer.train_step
        if self.device.type == "cuda":
            peak = _cuda_peak(train_step, rows, self.device)
        else:
            _, peak = cpu_peak_bytes(lambda: train_step(rows))
        times, metrics = ts.timed_steps(trainer, rows, timed_steps, self.device)
        result = {
            "seq_len": seq_len, "resident_mb": round(resident / MIB, 1), "peak_step_mb": round(peak / MIB, 1),
            "peak_total_mb": round((resident + peak) / MIB, 1),
            **timing_fields(times, metrics, peer=self.paths[path].get("peer")),
        }
        if keep:
            self.live[path] = trainer
        del trainer
        gc.collect()
        store[key] = result
        print(f"  {path:21s} L={seq_len:6d}" + (f" S={targets:5d}" if targets else "")
              + f"  peak {result['peak_total_mb']:10.1f} MiB"
              + (f"  {result['median_step_s']:8.3f} s/step" if times else ""), file=sys.stderr)
        return result

    def interleaved(self, paths: list[str], seq_len: int, steps: int) -> None:
        """Time step r of every kept trainer, then step r + 1, so background load on a shared machine
        falls on every path alike; the figures replace the paths' sequential ones."""
        rows = self.rows(seq_len)
        times: dict[str, list[float]] = {p: [] for p in paths}
        metrics: dict[str, list[dict]] = {p: [] for p in paths}
        for _ in range(steps):
            for path in paths:
                t, m = ts.timed_steps(self.live[path], rows, 1, self.device)
                times[path] += t
                metrics[path] += m
        for path in paths:
            fields = timing_fields(times[path], metrics[path], peer=self.paths[path].get("peer"))
            self.probes[(path, seq_len)].update(fields, interleaved=True)
            print(f"  {path:21s} L={seq_len:6d}  interleaved {statistics.median(times[path]):8.3f} s/step",
                  file=sys.stderr)
            del self.live[path]
        gc.collect()

    # ---- memory model and safety ----

    def predict_bytes(self, path: str, seq_len: int) -> float | None:
        """Peak total bytes at `seq_len` from the line through this path's probes (None without two)."""
        line = self.line(path)
        if line is None:
            return None
        l1, m1, slope = line
        return m1 + max(slope, 0.0) * (seq_len - l1)

    def safe(self, path: str, seq_len: int) -> bool:
        predicted = self.predict_bytes(path, seq_len)
        return predicted is None or predicted <= self.args.mem_fraction * available_bytes(self.device)

    def comparison_len(self) -> tuple[int, str]:
        """--seq-len, or the longest multiple of --len-step the full-logits path safely fits here."""
        want, step = self.args.seq_len, self.args.len_step
        if "full_logits" not in self.selected_paths():
            return want, ""
        for L in sorted({min(self.args.min_len, want), min(2 * self.args.min_len, want)}):
            self.measure("full_logits", L, timed_steps=self.args.steps if L == want else 0)
        if self.safe("full_logits", want):
            return want, ""
        L = want
        while L > step and not self.safe("full_logits", L):
            L -= step
        return L, (f"--seq-len {want}: the full-logits step is predicted to need "
                   f"{self.predict_bytes('full_logits', want) / 2**30:.1f} GiB, more than "
                   f"{self.args.mem_fraction:.0%} "
                   f"of available memory; compared at {L} instead")

    def selected_paths(self) -> list[str]:
        names = [p.strip() for p in self.args.paths.split(",") if p.strip()]
        if "compiled_ce" in self.paths and "compiled_ce" not in names:
            names.append("compiled_ce")
        unknown = set(names) - set(self.paths)
        if unknown:
            raise SystemExit(f"--paths: unknown {sorted(unknown)}; choose from {', '.join(self.paths)}")
        return names

    # ---- budget search ----

    def longest_fit(self, path: str, budget: float) -> dict[str, Any]:
        """Longest row (a multiple of --len-step in [--min-len, --max-len]) whose step fits `budget`:
        two short probes fit a line, the line's guess is probed, then growth or bisection."""
        a, step = self.args, self.args.len_step
        lo, hi, unsafe = 0, None, set()

        def probe(L: int) -> None:
            nonlocal lo, hi
            if not self.safe(path, L):
                unsafe.add(L)
                ok = False
            else:
                ok = self.measure(path, L)["peak_total_mb"] * MIB <= budget
            if ok:
                lo = max(lo, L)
            else:
                hi = L if hi is None else min(hi, L)

        probe(a.min_len)
        if lo and 2 * a.min_len <= a.max_len:
            probe(2 * a.min_len)
        line = self.line(path)
        guess = None
        if lo and line:
            l1, m1, slope = line
            guess = int(l1 + (budget - m1) / max(slope, 1.0))
            L = max(a.min_len, min(a.max_len, guess // step * step))
            if L > lo and (hi is None or L < hi):
                probe(L)
        while lo and hi is None and lo < a.max_len:  # grow by a quarter until a probe does not fit
            probe(min(a.max_len, (lo + max(step, lo // 4)) // step * step))
        while hi is not None and hi - lo > step and lo:  # bisect between the last fit and the first miss
            mid = lo + (hi - lo) // 2 // step * step
            if mid <= lo:
                break
            probe(mid)
        limited = ("search cap (--max-len)" if hi is None else
                   "machine memory (probe predicted over the safe limit; not run)" if hi in unsafe
                   else "budget")
        probes = [{"seq_len": L, "peak_total_mb": r["peak_total_mb"],
                   "fits": r["peak_total_mb"] * MIB <= budget}
                  for (p, L), r in sorted(self.probes.items()) if p == path]
        out = {"longest_fit_tokens": lo, "limited_by": limited, "probes": probes}
        line = self.line(path)
        if line:  # where the line through the two longest probes crosses the budget (beyond the cap too)
            l1, m1, slope = line
            out["linear_model_fit_tokens"] = int(l1 + (budget - m1) / max(slope, 1.0))
        return out

    def line(self, path: str) -> tuple[int, float, float] | None:
        """(length, bytes, bytes per token) from this path's two longest probes."""
        pts = sorted((L, r["peak_total_mb"] * MIB) for (p, L), r in self.probes.items() if p == path)
        if len(pts) < 2:
            return None
        (l0, m0), (l1, m1) = pts[-2], pts[-1]
        return l1, m1, (m1 - m0) / (l1 - l0)


def timing_fields(times: list[float], metrics: list[dict], *, peer: str | None = None) -> dict[str, Any]:
    """Step-time figures and branch counters of timed steps (none: just `steps: 0`). A peer's path also
    proves the peer ran: `peer_logprob_batches`, its forward passes, with every selective branch counter 0."""
    if not times:
        return {"steps": 0}
    runtime = ts.cumulative(metrics)
    out = {"steps": len(times), "median_step_s": statistics.median(times), "min_step_s": min(times),
           "max_step_s": max(times), "loss": metrics[-1].get("loss"),
           "branch_counters": {k: v for k, v in runtime.items() if k in proofs.BRANCH_COUNTERS}}
    if peer:
        ran = {k: v for k, v in out["branch_counters"].items() if v}
        if ran:
            raise RuntimeError(f"benchmarks/step.py: the {peer} path ran selective branches {ran}: the "
                               "trainer "
                               "did not use its log-prob hook (TrainerSpec.logprob_fn)")
        out["peer_logprob_batches"] = sum(m[names.FORWARD_PASSES] for m in metrics)
    return out


def _cuda_peak(train_step, rows, device) -> int:
    """Peak CUDA bytes allocated by one step above what was allocated when it started (the trainer's own
    peak reading, trainers/memory.py, less the bytes already allocated)."""
    sync(device)
    reset_peak(device)
    base = torch.cuda.memory_allocated(device)
    train_step(rows)
    sync(device)
    return round(peak_mem_mb(device)[0] * MIB) - base


def run(args) -> dict[str, Any]:
    device = resolve_bench_device(args.device)
    dtype = torch.float32 if args.dtype == "auto" and device.type == "cpu" else (
        torch.bfloat16 if args.dtype == "auto" else resolve_bench_dtype(args.dtype, device))
    doc: dict[str, Any] = environment(device, dtype)
    doc["config"] = {k: getattr(args, k) for k in (
        "seq_len", "targets", "turns", "vocab_size", "hidden_size", "layers", "chunk_size",
        "compile_selective_ce",
        "steps", "paths", "budget_gb", "min_len", "max_len", "len_step", "mem_fraction", "seed",
        "peer_chunk_size",
        "interleave", "sweep", "sweep_lengths", "sweep_densities", "sweep_paths")}
    bench = StepBench(args, device, dtype)
    doc["model"] = (f"random-init Qwen3: vocab {args.vocab_size}, hidden {args.hidden_size}, "
                    f"{args.layers} layers, {max(1, args.hidden_size // 16)} heads x head_dim 16, "
                    f"MLP {4 * args.hidden_size}, untied LM head, "
                    f"{doc['dtype']}, AdamW")
    print(f"quaero bench step on {device} ({doc['dtype']}):", file=sys.stderr)
    length, note = bench.comparison_len()
    paths = bench.selected_paths()
    comparison = {"seq_len": length, "seq_len_note": note}
    for path in paths:
        comparison[path] = bench.measure(path, length, timed_steps=0 if args.interleave else args.steps,
                                         keep=args.interleave)
    if args.interleave:
        bench.interleaved(paths, length, args.steps)
    comparison["row_layout"] = bench.layout
    full = comparison.get("full_logits")
    for path in paths:
        if full and path != "full_logits":
            r = comparison[path]
            r["memory_ratio_vs_full_logits"] = ratio(full["peak_total_mb"], r["peak_total_mb"])
            r["step_memory_ratio_vs_full_logits"] = ratio(full["peak_step_mb"], r["peak_step_mb"])
            r["speedup_vs_full_logits"] = ratio(full.get("median_step_s"), r.get("median_step_s"))
    against_peers(comparison, paths)
    doc["comparison"] = comparison
    if args.sweep:
        doc["sweep"] = sweep(bench, args, device)
    if args.budget_gb:
        budget = args.budget_gb * 2**30
        doc["budget"] = {"budget_gb": args.budget_gb, **{p: bench.longest_fit(p, budget) for p in paths}}
    return doc


def against_peers(cell: dict[str, Any], paths: list[str]) -> None:
    """Each selective path beside the floor (`backbone_only`) and the peers' `chunked_all_positions`:
    overhead = this / floor - 1 (time, total peak, step peak); ratios = chunked_all_positions / this."""
    floor, peer = cell.get(FLOOR), cell.get("chunked_all_positions")
    for path in paths:
        r = cell[path]
        if path in ("full_logits", FLOOR, "chunked_all_positions") or not r.get("median_step_s"):
            continue
        if floor:
            r["overhead_vs_backbone_time"] = _overhead(r["median_step_s"], floor.get("median_step_s"))
            r["overhead_vs_backbone_memory"] = _overhead(r["peak_total_mb"], floor["peak_total_mb"])
            r["step_overhead_vs_backbone_memory"] = _overhead(r["peak_step_mb"], floor["peak_step_mb"])
        if peer:
            r["speedup_vs_chunked_all_positions"] = ratio(peer.get("median_step_s"), r["median_step_s"])
            r["memory_ratio_vs_chunked_all_positions"] = ratio(peer["peak_total_mb"], r["peak_total_mb"])
            r["step_memory_ratio_vs_chunked_all_positions"] = ratio(peer["peak_step_mb"], r["peak_step_mb"])


def _overhead(value: float | None, floor: float | None) -> float | None:
    return round(value / floor - 1, 4) if value and floor else None


def sweep(bench: StepBench, args, device: torch.device) -> dict[str, Any]:
    """`--sweep-paths` at every (row length, target density): targets = density x length (>= --turns)."""
    lengths_default, densities_default = SWEEP_DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    lengths = [int(v) for v in (args.sweep_lengths or lengths_default).split(",")]
    densities = [float(v) for v in (args.sweep_densities or densities_default).split(",")]
    paths = [p.strip() for p in args.sweep_paths.split(",") if p.strip()]
    unknown = set(paths) - set(bench.paths)
    if unknown:
        raise SystemExit(f"--sweep-paths: unknown {sorted(unknown)}; choose from {', '.join(bench.paths)}")
    bad = [d for d in densities if not 0 < d < 1]
    if bad:
        raise SystemExit(f"--sweep-densities: {bad} is not in (0, 1); e.g. --sweep-densities 0.01,0.1,0.5")
    cells = []
    for length in lengths:
        for density in densities:
            targets = max(args.turns, round(density * length))
            cell: dict[str, Any] = {"seq_len": length, "density": density, "targets": targets}
            for path in paths:
                cell[path] = bench.measure(path, length, timed_steps=args.steps, targets=targets)
            against_peers(cell, paths)
            cells.append(cell)
    return {"paths": paths, "lengths": lengths, "densities": densities, "cells": cells}


def main(argv: list[str]) -> int:
    return run_cli(build_parser, run, argv)
