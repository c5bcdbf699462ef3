"""`quaero bench machine`: this machine's limits (matmul peak, memory bandwidth) and, given a finished run,
how close each of its phases came to them.

    quaero bench machine [--sizes 512,1024,2048] [--repeats 5] [--threads N] [--run RUN_DIR] [--json PATH]

- Matmul peak, GFLOPS per dtype (float32, bfloat16): `a @ b` on square n x n matrices is 2 n^3 floating
  point operations; the peak is the best (highest) of the per-size medians (`measure_regions`).
- Memory bandwidth, GB/s: `torch.add(x, y, out=z)` on float32 arrays of `--bandwidth-mb` each (well above
  the caches) reads two arrays and writes one: 3 x array bytes per call, over the median call time.
- The same limits per second of this process's CPU time (`cpu_time`, `cpu_time_limits`): on a core other
  processes share, wall time counts their turns too; CPU seconds (one torch thread) do not.
- With `--run RUN_DIR`, efficiencies from the run's own `train_step` events (means over its steps) and its
  weights (`final/` or the newest checkpoint, as `quaero bench scaling` sizes them):
  `training_efficiency` and `decoding_efficiency` below, each against this machine's figures (so measure
  on the machine that ran the run).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.measure import emit, environment, load_average, measure_regions, torch_threads
from quaero.telemetry import names

GB = 1e9
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class FlopParams:
    """The weights a token's matmuls read. The input embedding is a lookup (no FLOPs, one row read), so it is
    left out; the LM head is counted apart, since the selective head runs only at the loss's target positions.
    A tied model's head is its embedding matrix (`head` holds it once)."""

    backbone_trainable: int  # every other weight a trained step multiplies (a LoRA run: its adapters)
    backbone_frozen: int  # the rest of the backbone (a LoRA run's base weights)
    head: int  # the LM head's weight
    head_trainable: bool

    @classmethod
    def of(cls, model: torch.nn.Module) -> FlopParams:
        """From a built model (the meta device will do)."""
        embedding = model.get_input_embeddings().weight
        out = model.get_output_embeddings()
        head = out.weight if out is not None else embedding
        trainable = frozen = 0
        for p in model.parameters():  # parameters() yields a tied tensor once
            if p is embedding or p is head:
                continue
            if p.requires_grad:
                trainable += p.numel()
            else:
                frozen += p.numel()
        return cls(trainable, frozen, head.numel(), head.requires_grad)

    def train_flops(self, tokens: float, head_tokens: float) -> float:
        """FLOPs of a train step over `tokens` computed tokens whose head runs at `head_tokens` positions.

        A trained weight costs 6 FLOPs per token (2 forward, 2 for the input gradient, 2 for its own
        gradient), a frozen one 4 (no weight gradient). Attention's score/value products (O(L^2)) are not
        counted: at the main job's ~450-token rows they are a few percent of the step."""
        backbone = (6 * self.backbone_trainable + 4 * self.backbone_frozen) * tokens
        return backbone + (6 if self.head_trainable else 4) * self.head * head_tokens

    @property
    def decode_params(self) -> int:
        """Weights a decode step reads in full: the backbone and the head (the embedding: one row each)."""
        return self.backbone_trainable + self.backbone_frozen + self.head


def training_efficiency(*, flops: float, step_s: float, peak_flops: float) -> float:
    """Achieved / peak FLOPs of a train step (`flops` from `FlopParams.train_flops`)."""
    return flops / (step_s * peak_flops)


def decoding_efficiency(*, weight_bytes: float, decode_steps: float, decode_s: float,
                        bandwidth_bytes_per_s: float) -> float:
    """Achieved / peak memory traffic of decoding: weight_bytes x decode_steps / (decode_s x bandwidth).

    A decode step reads every weight once (the memory-bound part of sampling): `weight_bytes` are
    `FlopParams.decode_params` at the weights' bytes each. Above 1 means steps were batched (one read served
    several sequences); KV-cache reads are not counted."""
    return weight_bytes * decode_steps / (decode_s * bandwidth_bytes_per_s)


def matmul_gflops(sizes: list[int], repeats: int) -> dict[str, dict[str, Any]]:
    """Per dtype: GFLOPS of `a @ b` per size and the peak (the best size's median)."""
    out = {}
    for dname, dtype in DTYPES.items():
        mats = {n: (torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)) for n in sizes}
        fns = {str(n): (lambda a=a, b=b: a @ b) for n, (a, b) in mats.items()}
        timed = measure_regions(fns, torch.device("cpu"), repeats=repeats, memory_repeats=1)
        per_size = {n: 2 * int(n) ** 3 / r["median_s"] / GB for n, r in timed.items()}
        out[dname] = {"gflops_per_size": {n: round(g, 3) for n, g in per_size.items()},
                      "peak_gflops": round(max(per_size.values()), 3)}
    return out


def bandwidth_gb_s(array_mb: int, repeats: int) -> dict[str, Any]:
    """GB/s of `z = x + y` on float32 arrays of `array_mb` MiB: 3 arrays' bytes moved per call."""
    n = array_mb * 2**20 // 4
    x, y, z = torch.rand(n), torch.rand(n), torch.empty(n)
    timed = measure_regions({"add": lambda: torch.add(x, y, out=z)}, torch.device("cpu"),
                            repeats=repeats, memory_repeats=1)["add"]
    moved = 3 * n * 4
    return {"array_mb": array_mb, "bytes_per_call": moved, "median_s": timed["median_s"],
            "gb_s": round(moved / timed["median_s"] / GB, 3)}


def cpu_time_limits(sizes: list[int], array_mb: int, repeats: int, min_cpu_s: float = 0.2) -> dict[str, Any]:
    """The matmul peak (GFLOPS per dtype) and bandwidth (GB/s) per second of this process's CPU time: on a
    core other processes share, wall time also counts their turns, CPU time (with one torch thread) does not,
    so these are the yardstick for figures timed in CPU seconds. Each sample repeats the call for `min_cpu_s`;
    the median of `repeats` samples."""
    def rate(fn, work: float) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            calls, c0 = 0, time.process_time()
            while (spent := time.process_time() - c0) < min_cpu_s:
                fn()
                calls += 1
            samples.append(work * calls / spent / GB)
        return round(statistics.median(samples), 3)

    out: dict[str, Any] = {}
    for dname, dtype in DTYPES.items():
        mats = {n: (torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)) for n in sizes}
        per = {str(n): rate(lambda a=a, b=b: a @ b, 2 * n ** 3) for n, (a, b) in mats.items()}
        out[dname] = {"gflops_per_size": per, "peak_gflops": max(per.values())}
    n = array_mb * 2**20 // 4
    x, y, z = torch.rand(n), torch.rand(n), torch.empty(n)
    out["bandwidth_gb_s"] = rate(lambda: torch.add(x, y, out=z), 3 * n * 4)
    return out


def _meta_model(folder: str | Path) -> torch.nn.Module:
    """The model of a folder's (or hub id's) config on the meta device: its shapes, no weights loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def _run_params(run_dir: Path) -> tuple[FlopParams, float]:
    """The run's model as `FlopParams`, and its weights' bytes per parameter.

    A LoRA run's weights are its adapter (trainable); its frozen base and head are counted from the base
    model's config on the meta device."""
    from quaero.tools.scaling import _model_size

    nbytes, params = _model_size(run_dir)
    folder = next(f for f in [run_dir / names.FINAL,
                              *sorted((run_dir / names.CHECKPOINTS).glob("step-*"), reverse=True)]
                  if any(f.glob("*.safetensors")))
    adapter = folder / "adapter_config.json"
    if not adapter.exists():
        return FlopParams.of(_meta_model(folder)), nbytes / params
    base = FlopParams.of(_meta_model(json.loads(adapter.read_text())["base_model_name_or_path"]))
    return (FlopParams(params, base.backbone_trainable + base.backbone_frozen, base.head, False),
            nbytes / params)


def run_efficiency(run_dir: Path, peaks_gflops: dict[str, float], gb_s: float) -> dict[str, Any]:
    """Each phase's efficiency for a run, from its train_step events (means over steps with rows)."""
    from quaero.telemetry.runlog import read_events

    events, _ = read_events(run_dir / names.EVENTS)
    steps = [e for e in events if e.get("event") == names.TRAIN_STEP_EVENT
             and e.get(names.ROWS) and e.get(names.STEP_TIME_S)]
    if not steps:
        raise ValueError(f"{run_dir / names.EVENTS}: no train_step with trained rows and {names.STEP_TIME_S}")
    fp, bytes_per_param = _run_params(run_dir)

    def mean(key: str, among: list[dict[str, Any]]) -> float:
        return statistics.fmean(float(e.get(key) or 0.0) for e in among)

    tokens = statistics.fmean(computed_tokens(e) for e in steps)
    head_tokens = statistics.fmean(head_positions(e) for e in steps)
    step_s = mean(names.STEP_TIME_S, steps)
    # counts are all ranks', times the slowest rank's: R ranks had R devices' peak (as `bench scaling`)
    ranks = int(steps[-1].get(names.RANKS) or 1)
    flops = fp.train_flops(tokens, head_tokens)
    out: dict[str, Any] = {
        "run_dir": str(run_dir), "ranks": ranks, "train_steps": len(steps), "flop_params": vars(fp),
        "row_tokens_per_step": mean(names.ROW_TOKENS, steps), "tokens_per_step": tokens,
        "head_tokens_per_step": head_tokens, "train_flops_per_step": flops, "step_s": step_s,
        "training_efficiency": {d: round(training_efficiency(flops=flops, step_s=step_s * ranks,
                                                             peak_flops=g * GB), 4)
                                for d, g in peaks_gflops.items()}}
    rollouts = [e for e in steps if e.get(names.ROLLOUT_TIME_S) and e.get(names.ROLLOUT_ACTION_TOKENS)]
    if rollouts:
        decode_s = mean(names.ROLLOUT_TIME_S, rollouts) - mean(names.WEIGHT_SYNC_S, rollouts)
        decode_steps = mean(names.ROLLOUT_ACTION_TOKENS, rollouts)
        weight_bytes = round(fp.decode_params * bytes_per_param)
        out.update(weight_bytes=weight_bytes, decode_steps_per_step=decode_steps, decode_s=decode_s,
                   decoding_efficiency=round(decoding_efficiency(
                       weight_bytes=weight_bytes, decode_steps=decode_steps, decode_s=decode_s * ranks,
                       bandwidth_bytes_per_s=gb_s * GB), 4))
    return out


def computed_tokens(step: dict[str, Any]) -> float:
    """Tokens a train step's backbone computed: a packed microbatch's unique tokens, the others' row tokens.
    Exact when every microbatch a trie was built for was packed (`train_tree_packing` "on", or "auto" where it
    packed them all); a step with none packed counts its row tokens."""
    rows = float(step.get(names.ROW_TOKENS) or 0)
    if not step.get(names.TREE_BATCHES):
        return rows
    return rows - float(step.get(names.TREE_ROW_TOKENS) or 0) + float(step.get(names.TREE_UNIQUE_TOKENS) or 0)


def head_positions(step: dict[str, Any]) -> float:
    """Positions a step's LM head ran at: the loss's targets (action + ECHO tokens) on the selective path,
    every row token without it (the full [L, V] logits)."""
    if step.get(names.SELECTIVE_SUFFIX_LOGITS) is False:
        return float(step.get(names.ROW_TOKENS) or 0)
    return float(step.get(names.ACTION_TOKENS) or 0) + float(step.get(names.ECHO_TOKENS) or 0)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="quaero bench machine", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=_ints, default=[512, 1024, 2048], help="square matmul sizes")
    ap.add_argument("--bandwidth-mb", type=int, default=256, help="MiB per array of the add (above caches)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--run", type=Path, default=None, 
                    help="a finished run folder to rate against this machine")
    ap.add_argument("--json", default=None, help="also write the document here")
    return ap


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from quaero.tools.outputs import bench_output

    bench_output(args.json)  # a path it cannot write is refused before the work, not after
    with torch_threads(args.threads):
        doc: dict[str, Any] = environment(torch.device("cpu"), torch.float32)
        doc["matmul"] = matmul_gflops(args.sizes, args.repeats)
        doc["bandwidth"] = bandwidth_gb_s(args.bandwidth_mb, args.repeats)
        doc["cpu_time"] = cpu_time_limits(args.sizes, args.bandwidth_mb, args.repeats)
        doc["load_average_end"] = load_average()
    if args.run is not None:
        try:
            doc["run"] = run_efficiency(args.run, {d: m["peak_gflops"] for d, m in doc["matmul"].items()},
                                        doc["bandwidth"]["gb_s"])
        except (OSError, ValueError, KeyError) as e:
            print(f"error: --run {args.run}: {e}", file=sys.stderr)
            return 1
    emit(doc, args.json)
    for d, m in doc["matmul"].items():
        print(f"{d:>9} matmul peak {m['peak_gflops']:>9.2f} GFLOPS  per size {m['gflops_per_size']}",
              file=sys.stderr)
    print(f"{'memory':>9} bandwidth   {doc['bandwidth']['gb_s']:>9.2f} GB/s", file=sys.stderr)
    c = doc["cpu_time"]
    print(f"{'per CPU s':>9} matmul peak float32 {c['float32']['peak_gflops']:.2f}, bfloat16 "
          f"{c['bfloat16']['peak_gflops']:.2f} GFLOPS, bandwidth {c['bandwidth_gb_s']:.2f} GB/s "
          "(this process's CPU time: the yardstick on a shared core)", file=sys.stderr)
    if "run" in doc:
        r = doc["run"]
        print(f"{'run':>9} training efficiency {r['training_efficiency']}  decoding "
              f"{r.get('decoding_efficiency')}", file=sys.stderr)
    return 0
