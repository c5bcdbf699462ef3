"""`quaero bench crossover`: where the selective LM head stops winning against the peers' chunked one.

    quaero bench crossover --device cpu --lengths 512,2048 --vocab-sizes 32768,151936 \
        --densities 0.05,0.25,0.5,0.9

On one row of L hidden states [1, L, H] with S = density x (L - 1 - 16) targets spread evenly after a
16-token prefix, each region runs the LM head, the log-probs and the backward of `-mean` (the
`quaero bench echo` contract, benchmarks/regions.py). The backbone is left out: it is the same
for every method, so the region decides the step's difference. Regions:
- `suffix`, `hidden`, `hidden_chunked`: each branch of `trainers.selective.selected_logprobs`, forced;
- `chunked_all_positions`: the peers' method (benchmarks/peers.py), every position, chunk 512;
- `liger_fused_linear_ce` (CUDA, where `liger_kernel` imports): Liger's fused linear cross entropy
  over every position (targets elsewhere ignored); a scalar loss, not the per-token log-probs an RL
  ratio needs, so it is a lower bound on what Liger costs for RL.
Per cell the default decision (`selected_logprobs` with no options, as `quaero train` runs it) is
read off its `info.branch`, and the cell says whether that branch is the fastest quaero branch and
whether it beats `chunked_all_positions` in time and memory. A region predicted to need more than
`--mem-fraction` of available memory is skipped (and says so). Every region passes the float64 value
check of `quaero bench echo` on the grid's first cell before anything is timed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import torch

from benchmarks import peers
from benchmarks import regions as er
from benchmarks.measure import (
    available_bytes,
    environment,
    load_average,
    measure_regions,
    ratio,
    resolve_bench_device,
    resolve_bench_dtype,
    run_cli,
)
from trainers.spec import SelectivePolicy

PREFIX = 16  # tokens before the first target (a system prompt)
QUAERO_BRANCHES = ("suffix", "hidden", "hidden_chunked")
NEAR = 1.10  # a branch within 10% of the fastest counts as the fastest (timing noise on a shared machine)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quaero bench crossover", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--lengths", default="512,2048", help="comma-separated row lengths")
    p.add_argument("--vocab-sizes", default="32768,151936", help="comma-separated vocabulary sizes")
    p.add_argument("--densities", default="0.05,0.25,0.5,0.9", help="comma-separated targets / suffix slots")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=256, help="hidden_chunked's chunk")
    p.add_argument("--peer-chunk-size", type=int, default=peers.DEFAULT_PEER_CHUNK)
    p.add_argument("--regions", default=",".join((*QUAERO_BRANCHES, "chunked_all_positions")),
                   help="comma-separated regions to time and value-check "
                        "(the default branch is read either way)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-repeats", type=int, default=1,
                   help="CPU profiled runs (exact counts: 1 is enough)")
    p.add_argument("--min-sample-s", type=float, default=0.05)
    p.add_argument("--mem-fraction", type=float, default=0.6,
                   help="skip a region predicted to need more than this fraction of available memory")
    p.add_argument("--no-value-check", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    return p


def liger_region() -> er.Region | None:
    """Liger's fused linear CE over every position, or None where it does not import (CPU, no Triton)."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return None
    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def run(x: er.EchoInputs) -> float:
        labels = torch.where(x.target_mask[0, 1:], x.input_ids[0, 1:],
                             torch.full_like(x.input_ids[0, 1:], -100))
        loss = loss_fn(x.lm_head.weight, x.hidden[0, :-1], labels) / x.positions.numel()
        loss.backward()
        return float(loss.detach())

    return run


def predicted_bytes(name: str, x: er.EchoInputs, args) -> int:
    """fp32 [rows, V] blocks the region holds at once (logits, log-softmax/grad, and one spare)."""
    L, V, S = x.hidden.shape[1], x.lm_head.weight.shape[0], x.positions.numel()
    rows = {"suffix": L - 1 - PREFIX, "hidden": S, "hidden_chunked": min(args.chunk_size, S),
            "chunked_all_positions": args.peer_chunk_size,
            "liger_fused_linear_ce": args.peer_chunk_size}[name]
    return rows * V * 4 * 3


def measure_cell(x: er.EchoInputs, regions: dict, args, device) -> dict[str, Any]:
    limit = args.mem_fraction * available_bytes(device)
    fns, skipped = {}, {}
    for name, region in regions.items():
        need = predicted_bytes(name, x, args)
        if need > limit:
            skipped[name] = f"predicted {need / 2**30:.1f} GiB > {args.mem_fraction:.0%} of available memory"
            continue
        fns[name] = region if name == "liger_fused_linear_ce" else (lambda r=region: er.run_region(r, x))
    measured = measure_regions(fns, device, repeats=args.repeats, memory_repeats=args.memory_repeats,
                               before=x.clear_grads, min_sample_s=args.min_sample_s)
    out = {name: {"median_s": r["median_s"], "min_s": r["min_s"], "max_s": r["max_s"],
                  "samples_s": r["samples_s"],
                  "peak_mb": r["median_peak_allocated_mb"],
                  "loss": r["value"]} for name, r in measured.items()}
    out.update({name: {"skipped": why} for name, why in skipped.items()})
    return out


def verdict(cell: dict[str, Any]) -> dict[str, Any]:
    """Which quaero branch is fastest, and the default branch against it and against the peers."""
    timed = {b: cell[b] for b in QUAERO_BRANCHES if "median_s" in cell.get(b, {})}
    default, peer = cell["default_branch"], cell.get("chunked_all_positions", {})
    out: dict[str, Any] = {}
    if timed:
        fastest = min(timed, key=lambda b: timed[b]["median_s"])
        out["fastest_branch"] = fastest
        out["smallest_branch"] = min(timed, key=lambda b: timed[b]["peak_mb"])
    mine = timed.get(default)
    if mine is None:
        return out
    out["default_is_fastest"] = mine["median_s"] <= NEAR * timed[out["fastest_branch"]]["median_s"]
    out["default_vs_branch_paired"] = {b: paired_ratio(mine, r) for b, r in timed.items() if b != default}
    if "median_s" in peer:
        out["default_speedup_vs_chunked_all_positions"] = ratio(peer["median_s"], mine["median_s"])
        out["default_memory_ratio_vs_chunked_all_positions"] = ratio(peer["peak_mb"], mine["peak_mb"])
        out["default_wins_time"] = mine["median_s"] < peer["median_s"]
        out["default_wins_memory"] = mine["peak_mb"] <= peer["peak_mb"]
        best = timed[out["fastest_branch"]]
        out["best_branch_wins_time"] = best["median_s"] < peer["median_s"]
    return out


def paired_ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any] | None:
    """a's time / b's time, repeat by repeat (samples taken back to back share the machine's load):
    median, min, max, and `separated` when every repeat agrees on the side of 1 (with 7 repeats a
    sign test's chance of that under no difference is 2/128)."""
    pairs = [x / y for x, y in zip(a.get("samples_s", []), b.get("samples_s", [])) if y > 0]
    if not pairs:
        return None
    return {"median": round(statistics.median(pairs), 3), "min": round(min(pairs), 3),
            "max": round(max(pairs), 3),
            "repeats": len(pairs), "separated": min(pairs) > 1 or max(pairs) < 1}


def crossover_summary(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (vocab, length): the lowest density at which the default stops winning, in time and memory."""
    out = []
    for key in sorted({(c["vocab_size"], c["seq_len"]) for c in cells}):
        group = sorted((c for c in cells if (c["vocab_size"], c["seq_len"]) == key),
                       key=lambda c: c["density"])

        def first_loss(field: str, group: list = group) -> float | None:
            return next((c["density"] for c in group if c["verdict"].get(field) is False), None)

        out.append({"vocab_size": key[0], "seq_len": key[1],
                    "default_loses_time_from_density": first_loss("default_wins_time"),
                    "default_loses_memory_from_density": first_loss("default_wins_memory"),
                    "best_branch_loses_time_from_density": first_loss("best_branch_wins_time"),
                    "default_not_fastest_at": [c["density"] for c in group
                                               if c["verdict"].get("default_is_fastest") is False]})
    return out


def _ms(r: dict[str, Any]) -> str:
    return f"{r['median_s'] * 1e3:9.1f}" if "median_s" in r else f"{'skip':>9s}"


def _mb(r: dict[str, Any]) -> str:
    return f"{r['peak_mb']:8.1f}" if "peak_mb" in r else f"{'skip':>8s}"


def run(args) -> dict[str, Any]:
    device = resolve_bench_device(args.device)
    dtype = resolve_bench_dtype(args.dtype, device)
    lengths = [int(v) for v in args.lengths.split(",")]
    vocabs = [int(v) for v in args.vocab_sizes.split(",")]
    densities = [float(v) for v in args.densities.split(",")]
    if any(not 0 < d <= 1 for d in densities):
        raise SystemExit(f"--densities {args.densities}: each must be in (0, 1], e.g. 0.05,0.25,0.5,0.9")
    doc = environment(device, dtype)
    doc["config"] = {k: v for k, v in vars(args).items() if k != "json"}
    wanted = [r.strip() for r in args.regions.split(",") if r.strip()]
    unknown = sorted(set(wanted) - {*QUAERO_BRANCHES, "chunked_all_positions"})
    if unknown:
        raise SystemExit(f"--regions {args.regions}: unknown {unknown}; choose from "
                         f"{', '.join((*QUAERO_BRANCHES, 'chunked_all_positions'))}")
    regions: dict[str, Any] = {b: er.logprob_region(er.branch_policy(b, chunk_size=args.chunk_size))
                               for b in QUAERO_BRANCHES if b in wanted}
    if "chunked_all_positions" in wanted:  # the peer's chunk as the policy's chunk_size (benchmarks/peers.py)
        regions["chunked_all_positions"] = er.logprob_region(SelectivePolicy(chunk_size=args.peer_chunk_size),
                                                             peers.chunked_all_positions_logprobs)
    liger = liger_region() if device.type == "cuda" else None
    if liger is not None:
        regions["liger_fused_linear_ce"] = liger
    doc["liger"] = "measured" if liger is not None else "not available here (needs CUDA and liger_kernel)"
    cells, checked = [], None
    header = (f"{'V':>7s} {'L':>6s} {'dens':>5s} {'S':>6s} {'default':>14s} | ms: "
              + " ".join(f"{n[:9]:>9s}" for n in regions) + " | MiB: "
              + " ".join(f"{n[:8]:>8s}" for n in regions))
    print(f"quaero bench crossover on {device} ({doc['dtype']}):\n{header}", file=sys.stderr)
    for V in vocabs:
        for L in lengths:
            for d in densities:
                slots = L - 1 - PREFIX
                S = max(1, min(slots, round(d * slots)))
                x = er.make_inputs(seq_len=L, early_target_pos=PREFIX, selected_tokens=S, vocab_size=V,
                                   hidden_size=args.hidden_size, device=device, dtype=dtype, seed=args.seed)
                if checked is None and not args.no_value_check:
                    ref = er.reference(x)
                    checked = {n: er.check_region(n, r, x, ref,
                                                  expect_branch=n if n in QUAERO_BRANCHES else None)
                               for n, r in regions.items() if n != "liger_fused_linear_ce"}
                cell = {"vocab_size": V, "seq_len": L, "density": d, "targets": S,
                        "default_branch": er.default_branch(x), **measure_cell(x, regions, args, device),
                        "load_average": load_average()}
                cell["verdict"] = verdict(cell)
                cells.append(cell)
                print(f"{V:7d} {L:6d} {d:5.2f} {S:6d} {cell['default_branch']:>14s} | ms: "
                      + " ".join(_ms(cell[n]) for n in regions) + " | MiB: "
                      + " ".join(_mb(cell[n]) for n in regions) + f" | load {cell['load_average']}",
                      file=sys.stderr)
                del x
    doc["value_check"] = checked
    doc["cells"] = cells
    doc["crossover"] = crossover_summary(cells)
    doc["load_average_end"] = load_average()
    return doc


def main(argv: list[str]) -> int:
    return run_cli(build_parser, run, argv)
