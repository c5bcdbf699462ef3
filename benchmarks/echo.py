"""`quaero bench echo`: time and peak memory of each ECHO LM-head/loss region, value-checked first.

    quaero bench echo --device cpu --seq-len 4096 --early-target-pos 16 --selected-tokens 16 \\
        --vocab-size 8192 --hidden-size 64 --repeats 7

Prints one JSON document (every field documented in benchmarks/FIELDS.md) on
stdout and a short table on stderr; `--json PATH` also writes the document to PATH. Each region
is value-checked against a float64 full-vocabulary reference before it is timed (see
regions.py), then timed (forward + backward, median after a warm-up) and its peak memory
measured (see measure.py). `echo_train_smoke` runs real `LocalTrainer.train_step`s on the same
shape and reports the runtime metrics that prove which branch ran.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from benchmarks import regions as er
from benchmarks.measure import (
    MIB,
    environment,
    measure_regions,
    ratio,
    resolve_bench_device,
    resolve_bench_dtype,
    run_cli,
)
from quaero.telemetry import proofs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quaero bench echo", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto (cuda:0 if available, else cpu), cpu, cuda:0, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="hidden states and LM head dtype; auto = float16 on CUDA, float32 on CPU")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--early-target-pos", type=int, default=16,
                   help="hidden position of the first selected target (the suffix starts here)")
    p.add_argument("--selected-tokens", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--memory-repeats", type=int, default=3, help="CPU: profiled memory runs per region")
    p.add_argument("--min-sample-s", type=float, default=0.05,
                   help="a timing sample repeats a fast region until it lasts this long (timeit-style)")
    p.add_argument("--chunk-size", type=int, default=256, help="selected rows per chunk (chunked path)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--compile-selective-ce", default="off", choices=["off", "auto", "require"])
    p.add_argument("--compile-selective-ce-min-tokens", type=int, default=128)
    p.add_argument("--skip", action="append", default=[], metavar="REGION",
                   help="leave a region out (e.g. suffix_path at very large shapes); repeatable")
    p.add_argument("--no-smoke", action="store_true", help="skip echo_train_smoke")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's); 1 steadies timings on a busy shared machine")
    p.add_argument("--json", metavar="PATH", help="also write the JSON document here")
    return p


def regions(args) -> list[tuple[str, er.Region, str | None, bool]]:
    """(name, region, branch it must run, fallback allowed) in report order."""
    out: list[tuple[str, er.Region, str | None, bool]] = [
        ("suffix_path", er.logprob_region(er.branch_policy("suffix")), "suffix", False),
        ("selected_logsoftmax_path", er.selected_logsoftmax_path, None, False),
        ("selected_cross_entropy_path", er.logprob_region(er.branch_policy("hidden")), "hidden", False),
        ("selected_chunked_recompute_path",
         er.logprob_region(er.branch_policy("hidden_chunked", chunk_size=args.chunk_size)), "hidden_chunked",
         False),
    ]
    if args.compile_selective_ce != "off":
        policy = er.branch_policy("compiled", compile_mode=args.compile_selective_ce,
                                  compile_min_tokens=args.compile_selective_ce_min_tokens)
        out.append(("selected_compiled_ce_path", er.logprob_region(policy), "compiled",
                    args.compile_selective_ce == "auto"))
    unknown = set(args.skip) - {name for name, *_ in out}
    if unknown:
        raise SystemExit(f"--skip {sorted(unknown)}: not a region here; regions: {[n for n, *_ in out]}")
    return [r for r in out if r[0] not in args.skip]


def region_benchmark(args, device: torch.device, dtype: torch.dtype) -> tuple[dict, dict]:
    x = er.make_inputs(seq_len=args.seq_len, early_target_pos=args.early_target_pos,
                       selected_tokens=args.selected_tokens, vocab_size=args.vocab_size,
                       hidden_size=args.hidden_size, device=device, dtype=dtype, seed=args.seed)
    x.temperature = args.temperature
    slots = args.seq_len - 1 - args.early_target_pos
    n_sel = int(x.positions.numel())
    bench: dict[str, Any] = {
        "suffix_slots": slots,
        "selected_positions_first_last": [int(x.positions[0]), int(x.positions[-1])],
        "suffix_logits_elements": slots * args.vocab_size,
        "selected_logits_elements": n_sel * args.vocab_size,
        "element_ratio": round(slots / n_sel, 3),
        "suffix_logits_approx_mib_fp32": round(slots * args.vocab_size * 4 / MIB, 3),
        "selected_logits_approx_mib_fp32": round(n_sel * args.vocab_size * 4 / MIB, 3),
        "chunk_logits_approx_mib_fp32": round(min(args.chunk_size, n_sel) * args.vocab_size * 4 / MIB, 3),
    }
    todo = regions(args)
    # 1. every region must agree with the full-vocabulary reference before anything is timed
    ref = er.reference(x)
    checks = {name: er.check_region(name, region, x, ref, expect, fallback)
              for name, region, expect, fallback in todo}
    del ref
    # 2. time and memory, interleaved across regions
    stats = measure_regions({name: (lambda r=region: er.run_region(r, x)) for name, region, _, _ in todo},
                            device, repeats=args.repeats, memory_repeats=args.memory_repeats,
                            before=x.clear_grads, min_sample_s=args.min_sample_s)
    for name, *_ in todo:
        bench[name] = {**stats[name], "branch": checks[name]["branch"], "info": checks[name]["info"]}
        print(f"  {name:34s} {stats[name]['median_s'] * 1e3:10.3f} ms "
              f"{stats[name]['median_peak_allocated_mb']:10.3f} MiB  branch={checks[name]['branch']}",
              file=sys.stderr)
    _add_ratios(bench)
    return bench, checks


def _add_ratios(bench: dict) -> None:
    """Speedups (other time / this time) and memory ratios (other peak / this peak) between regions."""
    def t(name):
        return bench.get(name, {}).get("median_s")

    def m(name):
        return bench.get(name, {}).get("median_peak_allocated_mb")

    for name, stats in list(bench.items()):
        if isinstance(stats, dict) and name != "suffix_path" and "median_s" in stats:
            stats["speedup_vs_suffix"] = ratio(t("suffix_path"), t(name))
            stats["memory_ratio_vs_suffix"] = ratio(m("suffix_path"), m(name))
    ce = "selected_cross_entropy_path"
    bench["selected_ce_speedup_vs_logsoftmax"] = ratio(t("selected_logsoftmax_path"), t(ce))
    bench["selected_ce_speedup_vs_suffix"] = ratio(t("suffix_path"), t(ce))
    bench["selected_ce_memory_ratio_vs_suffix"] = ratio(m("suffix_path"), m(ce))
    bench["selected_chunked_time_ratio_vs_eager_ce"] = ratio(t("selected_chunked_recompute_path"), t(ce))
    bench["selected_chunked_memory_ratio_vs_eager_ce"] = ratio(m(ce), m("selected_chunked_recompute_path"))
    if "selected_compiled_ce_path" in bench:
        bench["selected_compiled_ce_speedup_vs_eager_ce"] = ratio(t(ce), t("selected_compiled_ce_path"))
        bench["selected_compiled_ce_memory_ratio_vs_eager_ce"] = ratio(m(ce), m("selected_compiled_ce_path"))


def echo_train_smoke(args, device: torch.device) -> dict[str, Any]:
    """`min(repeats, 3)` real `local` train steps on one row of the benchmark's shape: a tiny Qwen3
    (vocab, hidden) and the region benchmark's selected targets (the last one an action with RL
    advantage, the others environment tokens with ECHO weight), proving which branch ran."""
    import statistics

    from benchmarks import trainstep as ts

    positions = er.selected_positions(args.seq_len, args.early_target_pos, args.selected_tokens)
    targets = [p + 1 for p in positions]
    ids = torch.randint(0, args.vocab_size, (args.seq_len,),
                        generator=torch.Generator().manual_seed(args.seed))
    row = ts.row_with_targets(ids.tolist(), env_targets=targets[:-1], action_targets=targets[-1:])
    spec = ts.bench_spec(ts.bench_model_dir(args.vocab_size, args.hidden_size), seq_len=args.seq_len,
                         dtype="bfloat16" if args.dtype == "bfloat16" else "float32",
                         compile_mode=args.compile_selective_ce,
                         compile_min_tokens=args.compile_selective_ce_min_tokens,
                         temperature=args.temperature)
    trainer = ts.make_trainer(spec, device)
    times, metrics = ts.timed_steps(trainer, [row], min(args.repeats, 3), device)
    runtime = ts.cumulative(metrics)
    checks = proofs.branch_checks(runtime)
    # the row is sparse by construction, so the sparse proof must pass here (n/a is a failure)
    unmet = proofs.unmet(checks, require_proof=True, names=[proofs.SPARSE_ECHO])
    print(f"  echo_train_smoke: {len(times)} local train steps, proof "
          f"{'; '.join(unmet) if unmet else 'OK'}", file=sys.stderr)
    return {"steps": len(times), "median_s": statistics.median(times), "min_s": min(times),
            "max_s": max(times),
            "value": metrics[-1]["loss"], "row_layout": f"one row of {args.seq_len} tokens; ECHO targets at "
            f"tokens {targets[:-1][:3]}...; RL action target at token {targets[-1]}",
            "runtime_metrics": runtime, "last_step_metrics": metrics[-1],
            "proof": [c.to_dict() for c in checks], "proof_unmet": unmet, "proof_ok": not unmet}


def run(args) -> dict[str, Any]:
    device = resolve_bench_device(args.device)
    dtype = resolve_bench_dtype(args.dtype, device)
    torch.manual_seed(args.seed)
    doc: dict[str, Any] = environment(device, dtype)
    doc["config"] = {k: getattr(args, k) for k in (
        "seq_len", "early_target_pos", "selected_tokens", "vocab_size", "hidden_size", "repeats",
        "memory_repeats", "min_sample_s", "chunk_size", "temperature", "compile_selective_ce",
        "compile_selective_ce_min_tokens", "seed")}
    print(f"quaero bench echo on {device} ({doc['dtype']}):", file=sys.stderr)
    doc["region_benchmark"], doc["value_check"] = region_benchmark(args, device, dtype)
    if not args.no_smoke:
        doc["echo_train_smoke"] = echo_train_smoke(args, device)
    return doc


def smoke_problem(doc: dict[str, Any]) -> str | None:
    """Why `echo_train_smoke`'s proof failed (None when it held or did not run)."""
    smoke = doc.get("echo_train_smoke") or {}
    if smoke.get("proof_ok") is False:
        return f"echo_train_smoke proof failed: {'; '.join(smoke['proof_unmet'])}"
    return None


def main(argv: list[str]) -> int:
    return run_cli(build_parser, run, argv, verdict=smoke_problem)
