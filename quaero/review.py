"""`quaero review RUN_DIR`: read a run's events.jsonl and prove which optimized branch ran.

Works on a finished run, a resumed run (a step that was re-run after a resume counts once: the
latest record wins) and a run that crashed halfway (a torn last line is skipped).

Proofs (the seed's "Metrics to check", computed from the per-step counters summed over steps):
  sparse ECHO   local_train_selective_sparse_suffix_skips > 0,
                local_train_selective_hidden_logprob_batches > 0,
                local_train_selective_fallback_logprob_batches = 0
  compiled CE   only when local_train_compile_selective_ce_mode = require:
                local_train_selective_compiled_ce_batches > 0 and an empty fallback reason
  exactness     prefix_mismatches = 0 (invariant 2 of DESIGN.md)
Signals (reported, not required): ECHO loss falling; eval reward above the untrained baseline.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from quaero.metrics import read_events

PLOT_SERIES = {
    "reward": ["reward_mean", "eval_reward"],
    "losses": ["rl_loss", "echo_loss", "sft_loss"],
    "memory": ["peak_mem_mb"],
    "branches": ["local_train_selective_hidden_logprob_batches", "local_train_selective_sparse_suffix_skips",
                 "local_train_selective_suffix_logprob_batches", "local_train_selective_fallback_logprob_batches",
                 "local_train_selective_compiled_ce_batches"],
}


def load_run(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "events.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no events.jsonl here; pass the run folder, e.g. runs/toolbench")
    events = read_events(path)
    steps: dict[tuple, dict] = {}
    evals: dict[int, dict] = {}
    for e in events:
        if e.get("event") == "train_step":
            steps[(e.get("phase", "rl"), e.get("step"))] = e  # a re-run step after resume: latest wins
        elif e.get("event") == "eval":
            evals[e.get("step")] = e
    ordered = sorted(steps.values(), key=lambda e: (e.get("step", 0), e.get("phase") != "sft"))
    return {"path": str(path), "events": events, "steps": ordered,
            "evals": [evals[k] for k in sorted(evals)], "ended": any(e.get("event") == "run_end" for e in events)}


def _sum(steps: list[dict], key: str) -> int | float:
    return sum(s.get(key) or 0 for s in steps if isinstance(s.get(key), (int, float)))


def _last(steps: list[dict], key: str, default: Any = None) -> Any:
    for s in reversed(steps):
        if key in s:
            return s[key]
    return default


def _series(steps: list[dict], key: str) -> list[float]:
    return [float(s[key]) for s in steps if isinstance(s.get(key), (int, float)) and not isinstance(s[key], bool)]


def _head_tail(values: list[float], k: int = 3) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    k = max(1, min(k, len(values) // 2 or 1))
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def summarize(run: dict) -> dict[str, Any]:
    steps, evals = run["steps"], run["evals"]
    rl = [s for s in steps if s.get("phase", "rl") == "rl"]
    # a step without ECHO targets logs echo_loss 0: not a point of the ECHO learning curve
    echo_first, echo_last = _head_tail(_series([st for st in steps if st.get("echo_tokens", 1)], "echo_loss"))
    rl_first, rl_last = _head_tail(_series(rl, "rl_loss"))
    rew_first, rew_last = _head_tail(_series(rl, "reward_mean"))
    eval_rewards = [e.get("eval_reward") for e in evals if e.get("eval_reward") is not None]
    times = _series(steps, "step_time_s")
    gap = _series(rl, "sampler_logprob_gap_max")
    return {
        "steps": len(steps), "sft_steps": len(steps) - len(rl), "rl_steps": len(rl),
        "last_step": steps[-1].get("step") if steps else None, "finished": run["ended"],
        "train_reward_first": rew_first, "train_reward_last": rew_last,
        "train_success_last": _last(rl, "success_rate"),
        "eval_reward_baseline": eval_rewards[0] if eval_rewards else None,
        "eval_reward_last": eval_rewards[-1] if eval_rewards else None,
        "eval_success_last": evals[-1].get("eval_success_rate") if evals else None,
        "rl_loss_first": rl_first, "rl_loss_last": rl_last,
        "echo_loss_first": echo_first, "echo_loss_last": echo_last,
        "action_tokens": _sum(steps, "action_tokens"), "echo_tokens": _sum(steps, "echo_tokens"),
        "row_tokens": _sum(steps, "row_tokens"),
        "step_time_median_s": statistics.median(times) if times else None,
        "peak_mem_mb": max(_series(steps, "peak_mem_mb"), default=None),
        "env_retries": _sum(steps, "env_retries"), "episodes_dropped": _sum(steps, "episodes_dropped"),
        "malformed_actions": _sum(steps, "malformed_actions"),
        "bridge_fallbacks": _sum(steps + evals, "bridge_fallbacks"),
        "prefix_mismatches": _sum(steps + evals, "prefix_mismatches"),
        "rows_packed": _sum(steps, "rows_packed"), "rows_transition": _sum(steps, "rows_transition"),
        "sampler_logprob_gap_max": max(gap, default=None),
        "local_train_selective_suffix_logits": _last(steps, "local_train_selective_suffix_logits"),
        "local_train_compile_selective_ce_mode": _last(steps, "local_train_compile_selective_ce_mode", ""),
        # the latest reason given (a step with no targets attempts no compile and gives none)
        "local_train_compile_selective_ce_fallback_reason":
            _last([st for st in steps if st.get("local_train_compile_selective_ce_fallback_reason")],
                  "local_train_compile_selective_ce_fallback_reason", ""),
        **{k: _sum(steps, k) for k in ("local_train_selective_sparse_suffix_skips",
                                        "local_train_selective_hidden_logprob_batches",
                                        "local_train_selective_compiled_ce_batches",
                                        "local_train_selective_suffix_logprob_batches",
                                        "local_train_selective_fallback_logprob_batches")},
    }


def proofs(s: dict) -> list[dict]:
    """Each check: name, passed, required (counts for --require-proof), detail."""
    sparse = (s["local_train_selective_sparse_suffix_skips"] > 0 and s["local_train_selective_hidden_logprob_batches"] > 0
              and s["local_train_selective_fallback_logprob_batches"] == 0)
    checks = [
        {"name": "sparse ECHO proof", "required": True, "passed": bool(sparse),
         "detail": f"sparse_suffix_skips={s['local_train_selective_sparse_suffix_skips']} > 0, "
                   f"hidden_logprob_batches={s['local_train_selective_hidden_logprob_batches']} > 0, "
                   f"fallback_logprob_batches={s['local_train_selective_fallback_logprob_batches']} = 0"},
        {"name": "exact rows (prefix mismatches)", "required": True, "passed": s["prefix_mismatches"] == 0,
         "detail": f"prefix_mismatches={s['prefix_mismatches']} = 0"},
        {"name": "trained at least one step", "required": True, "passed": s["steps"] > 0,
         "detail": f"steps={s['steps']}"},
    ]
    if s["local_train_compile_selective_ce_mode"] == "require":
        ok = (s["local_train_selective_compiled_ce_batches"] > 0
              and s["local_train_compile_selective_ce_fallback_reason"] == "")
        checks.append({"name": "compiled CE proof", "required": True, "passed": bool(ok),
                       "detail": f"mode=require, compiled_ce_batches={s['local_train_selective_compiled_ce_batches']}"
                                 f" > 0, fallback_reason={s['local_train_compile_selective_ce_fallback_reason']!r}"})
    if s["echo_loss_first"] is not None:
        checks.append({"name": "ECHO loss falling", "required": False,
                       "passed": s["echo_loss_last"] < s["echo_loss_first"],
                       "detail": f"{s['echo_loss_first']:.4f} -> {s['echo_loss_last']:.4f}"})
    if s["eval_reward_baseline"] is not None and s["eval_reward_last"] is not None:
        checks.append({"name": "eval reward above untrained", "required": False,
                       "passed": s["eval_reward_last"] > s["eval_reward_baseline"],
                       "detail": f"{s['eval_reward_baseline']:.3f} -> {s['eval_reward_last']:.3f}"})
    return checks


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_table(rows: list[tuple[str, list[Any]]], header: list[str]) -> str:
    cells = [header] + [[k] + [_fmt(v) for v in vs] for k, vs in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_plots(run: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = run["steps"] + run["evals"]
    written = []
    for name, keys in PLOT_SERIES.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in keys:
            pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))
                   and not isinstance(r.get(key), bool)]
            if pts:
                ax.plot(*zip(*sorted(pts)), marker="o", ms=3, label=key.replace("local_train_selective_", ""))
        ax.set_xlabel("step")
        ax.set_title(name)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def main(args) -> int:
    if args.compare:
        a, b = (summarize(load_run(d)) for d in args.compare)
        if args.json:
            print(json.dumps({"a": a, "b": b}, indent=2))
        else:
            print(render_table([(k, [a[k], b[k]]) for k in a], ["metric", *args.compare]))
        return 0
    if not args.run_dir:
        print("error: quaero review RUN_DIR (or --compare RUN_A RUN_B)", file=sys.stderr)
        return 1
    try:
        run = load_run(args.run_dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    s = summarize(run)
    checks = proofs(s)
    plots = [str(p) for p in write_plots(run, args.plots)] if args.plots else []
    failed = [c for c in checks if c["required"] and not c["passed"]]
    if args.json:
        print(json.dumps({"summary": s, "checks": checks, "plots": plots}, indent=2))
    else:
        print(f"run {args.run_dir} ({'finished' if s['finished'] else 'INCOMPLETE: no run_end event'})")
        print(render_table([(k, [v]) for k, v in s.items() if k != "finished"], ["metric", "value"]))
        print()
        for c in checks:
            tag = "PASS" if c["passed"] else ("FAIL" if c["required"] else "WARN")
            print(f"[{tag}] {c['name']}: {c['detail']}")
        for p in plots:
            print(f"plot {p}")
    return 1 if (args.require_proof and failed) else 0
