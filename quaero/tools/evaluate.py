"""`quaero eval`: a model (or a scripted policy) on the env's eval split, with intervals, and
`--compare A B` on identical episodes with the paired difference.

Episodes run through training evaluation's loop (quaero/recipe/evaluation.py), one episode per (task, seed):
task i of repetition r is training evaluation's task i under run seed + r, and the driver's sampler
seed is run seed + r, so r = 0 greedy reproduces the run's own eval events. Success rates count
episodes that finished (dropped ones are reported, not scored), as in training evaluation.

A contestant (`--model`, each side of `--compare`) is one of:
- a run folder (runs/NAME): its final/ folder, else its newest checkpoint, exported to a temporary folder;
- a model folder `quaero export` wrote (config.json), or a PEFT adapter folder (adapter_config.json);
- `package.module:function`, a scripted policy `function(info) -> (messages -> assistant message)`
  (the env's `oracle_policy`, say: the ceiling of a task set);
- nothing: the config's own [model] (the untrained baseline).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from quaero.config import QuaeroConfig
from quaero.recipe.model_folder import ExportError
from quaero.resolve import resolve_name
from quaero.rollout.advantages import safe_mean
from quaero.telemetry import names
from quaero.telemetry.heldout import held_out_figures, pass_figures
from quaero.telemetry.proofs import format_task_line
from quaero.telemetry.runlog import error_line
from quaero.tools.export import export_run, is_adapter, load_model
from quaero.tools.significance import fixed_and_regressed, format_and_task, paired_outcomes, wilson_interval

if TYPE_CHECKING:
    from quaero.rollout.driver import Policy

_POLICY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class EvalError(RuntimeError):
    """A --model/--compare value or option that cannot be evaluated; one line for the user."""


@dataclass
class Contestant:
    label: str  # what the user named
    folder: Path | None = None  # a model or adapter folder (None: scripted policy or the config's model)
    policy: Policy | None = None  # scripted: info -> (messages -> assistant message)
    # where its eval folder goes by default (a run folder; never a folder it only reads)
    home: Path | None = None


@dataclass
class Result:
    """One contestant's episodes (in (repeat, task) order) and the counters the driver kept."""

    label: str
    records: list[dict]
    malformed_actions: int
    # pass@k's sampled episodes per (repeat, task): {"repeat", "task", "successes", "samples"}; [] when off
    passes: list[dict] = field(default_factory=list)
    pass_k: int = 1

    @property
    def finished(self) -> list[dict]:
        return [r for r in self.records if not r["dropped"]]

    def summary(self) -> dict:
        done = self.finished
        wins = sum(r["success"] for r in done)
        well = [r for r in done if not r.get("malformed")]
        low, high = wilson_interval(wins, len(done))
        held = held_out_figures([r["success"] for r in done], [r.get("malformed", 0) for r in done])
        passes = ({"pass_at_k": pass_figures([(p["successes"], p["samples"]) for p in self.passes],
                                             self.pass_k), "pass_results": self.passes}
                  if self.pass_k > 1 else {})
        return {"model": self.label, "episodes": len(self.records), "finished": len(done),
                "dropped": len(self.records) - len(done), "successes": wins,
                "success_rate": wins / len(done) if done else None, "success_ci95": [low, high],
                "success_se": held["success_se"], "format_failures": held["format_failures"],
                "wrong_answers": held["wrong_answers"],
                "reward_mean": _mean([r["reward"] for r in done]),
                "turns_mean": _mean([r["turns"] for r in done]),
                "malformed_actions": self.malformed_actions,
                # format and task apart: episodes with no malformed action, and success among them
                "well_formed": len(well) / len(done) if done else None,
                "success_among_well_formed": (sum(r["success"] for r in well) / len(well)) if well else None,
                **passes}


def _mean(xs: list[float]) -> float | None:
    return safe_mean(xs) if xs else None


@dataclass
class EvalPlan:
    tasks: int
    split: str
    seeds: int = 1
    greedy: bool = True
    pass_k: int = 1  # > 1: also k episodes per task sampled at the sampler's temperature, for pass@k
    out: Path | None = None
    stamp: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S"))


# ── contestants ─────────────────────────────────────────────────────────────────────────────────────

def resolve(spec: str | None, cfg: QuaeroConfig, scratch: contextlib.ExitStack) -> Contestant:
    """What `--model SPEC` names (see the module docstring). `scratch` owns any temporary export."""
    if spec is None:
        return Contestant(cfg.model.name, home=cfg.run_dir)
    path = Path(spec).expanduser()
    if path.is_dir() and ((path / names.CHECKPOINTS).is_dir() or (path / names.FINAL).is_dir()):
        return _run_contestant(spec, path, scratch)  # a run folder (its config.json is quaero's, not HF's)
    if path.is_dir() and ((path / "config.json").exists() or is_adapter(path)):
        _check_model_folder(spec, path)
        return Contestant(spec, folder=path, home=cfg.run_dir)  # never beside a folder the user only reads
    if not path.exists() and _POLICY.match(spec):
        # os:system, a class, a constant: never called with an episode's info
        scripted = "a scripted policy is `def policy(info) -> (messages -> assistant message)`"
        policy = resolve_name(spec, "--model", want=inspect.isfunction, wanted="a Python function",
                              fix=scripted,
                              error=EvalError, example="my_env.oracle:oracle_policy")
        return Contestant(spec, policy=policy, home=cfg.run_dir)
    raise EvalError(f"--model {spec}: not a run folder (runs/NAME), a model folder (config.json or "
                    "adapter_config.json) or a scripted policy package.module:function")


def _check_model_folder(spec: str, folder: Path) -> None:
    """The folder's config is a Hugging Face (or PEFT adapter) config: a foreign folder fails here, in one
    line, before any env server starts."""
    name = "adapter_config.json" if is_adapter(folder) else "config.json"
    try:
        if name == "config.json":
            from transformers import AutoConfig

            # never run (or offer to run) its code
            AutoConfig.from_pretrained(folder, trust_remote_code=False)
        elif not isinstance(
            json.loads((folder / name).read_text(encoding="utf-8"))["base_model_name_or_path"], str
        ):
            raise TypeError("base_model_name_or_path is not a string")
    except Exception as e:  # noqa: BLE001 - whatever a foreign file makes the parser raise
        raise EvalError(f"--model {spec}: {folder / name} is not a Hugging Face model config "
                        f"({error_line(e, 200)}); pass a folder `quaero export` wrote, a run folder or a hub "
                        "model") from None


def _run_contestant(spec: str, run: Path, scratch: contextlib.ExitStack) -> Contestant:
    if (run / names.FINAL).is_dir():
        return Contestant(spec, folder=run / names.FINAL, home=run)
    tmp = Path(scratch.enter_context(tempfile.TemporaryDirectory(prefix="quaero-eval-"))) / "model"
    try:  # an interrupted run has no final/: its newest checkpoint is what it has
        export_run(run, tmp, merge=True)
    except ExportError as e:
        raise EvalError(f"--model {spec}: {e}") from None
    return Contestant(spec, folder=tmp, home=run)


def _with(cfg: QuaeroConfig, section: str, **fields) -> QuaeroConfig:
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=fields)})


def _tokenizer(cfg: QuaeroConfig, who: Contestant):
    """An exported folder carries the tokenizer it was trained with; anything else uses the config's."""
    from quaero.models.load import load_tokenizer

    if who.folder is not None and (who.folder / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(who.folder, trust_remote_code=False)
    return load_tokenizer(cfg.model.name)


def _sampler(cfg: QuaeroConfig, who: Contestant, stop_token_ids: list[int]):
    from quaero.models.load import resolve_device
    from quaero.sampling import make_sampler

    if who.policy is not None:
        return None  # a scripted policy never samples
    device = resolve_device(cfg.run.device)
    if who.folder is None:
        return make_sampler(cfg, stop_token_ids=stop_token_ids, device=device)
    model = None
    if is_adapter(who.folder):
        if cfg.sampler.backend == "vllm":
            raise EvalError(f"--model {who.label}: a LoRA adapter folder and [sampler] backend='vllm'; "
                            "export a merged folder (quaero export RUN --merge OUT) or use --set "
                            "sampler.backend=hf")
        model = load_model(who.folder, cfg.model.dtype, device)
    return make_sampler(_with(cfg, "model", name=str(who.folder)), model=model, stop_token_ids=stop_token_ids,
                        device=device)


# ── running ─────────────────────────────────────────────────────────────────────────────────────────

def run_contestant(cfg: QuaeroConfig, who: Contestant, pool, plan: EvalPlan,
                   kept: list | None = None) -> Result:
    """All (repeat, task) episodes of one contestant through training evaluation's loop (quaero/recipe/
    evaluation.py `eval_episodes`); each repeat's records are appended to `kept` as they finish (an
    interrupted eval writes those)."""
    from quaero.config import settings_of
    from quaero.recipe.evaluation import eval_episodes
    from quaero.rollout.driver import DriverSettings, EpisodeDriver
    from quaero.rollout.render import RenderAdapter

    try:
        render = RenderAdapter(_tokenizer(cfg, who), cfg.model)
        sampler = _sampler(cfg, who, render.stop_token_ids)
    except EvalError:
        raise
    # a truncated safetensors, a pickle-only folder, a foreign tokenizer
    except Exception as e:  # noqa: BLE001
        raise EvalError(f"--model {who.label}: cannot load it ({error_line(e, 200)}); pass a folder `quaero "
                        "export` wrote (safetensors), a run folder or a hub model") from None
    pool.counts.snapshot_and_reset()  # this contestant's counts only
    driver = EpisodeDriver(render, sampler, settings_of(DriverSettings, cfg), pool.counts)
    records = [] if kept is None else kept
    try:
        for r in range(plan.seeds):
            seed = cfg.run.seed + r
            try:
                tasks, groups = eval_episodes(_with(cfg, "run", seed=seed), driver, pool, plan.split,
                                              plan.tasks, seed=seed, greedy=plan.greedy, policy=who.policy)
            except Exception as e:
                if who.policy is None:
                    raise
                raise EvalError(f"--model {who.label}: the scripted policy raised ({error_line(e, 200)}); "
                                "fix the policy") from None
            for task, (ep,) in zip(tasks, groups):
                records.append({"task": task["index"], "split": task["split"], "seed": task["seed"],
                                "repeat": r,
                                "reward": ep.reward, "success": bool(ep.success), "turns": ep.turns,
                                "malformed": ep.malformed, "dropped": ep.dropped,
                                "drop_reason": ep.drop_reason, "messages": ep.messages})
        malformed = int(pool.counts.snapshot_and_reset()["malformed_actions"])  # the greedy episodes' alone
        passes = _passes(cfg, who, driver, pool, plan) if plan.pass_k > 1 else []
    finally:
        if sampler is not None:
            sampler.close()
    return Result(who.label, records, malformed, passes, plan.pass_k)


def _passes(cfg: QuaeroConfig, who: Contestant, driver, pool, plan: EvalPlan) -> list[dict]:
    """pass@k's episodes: k per (repeat, task), sampled at the sampler's temperature from the repeat's seed,
    on the very tasks of the main episodes; each task's finished samples and successes among them."""
    from quaero.recipe.evaluation import eval_episodes

    out = []
    for r in range(plan.seeds):
        seed = cfg.run.seed + r
        tasks, groups = eval_episodes(_with(cfg, "run", seed=seed), driver, pool, plan.split, plan.tasks,
                                      seed=seed, greedy=False, policy=who.policy, samples=plan.pass_k)
        out += [{"repeat": r, "task": t["index"], "successes": sum(bool(ep.success) for ep in g
                                                                   if not ep.dropped),
                 "samples": sum(not ep.dropped for ep in g)} for t, g in zip(tasks, groups)]
    pool.counts.snapshot_and_reset()  # kept out of the next contestant's counts
    return out


def paired(a: Result, b: Result, seed: int = 0) -> dict:
    """A - B on the episodes both finished: success (McNemar exact) and reward (paired bootstrap)."""
    a_by, b_by = ({(r["repeat"], r["task"]): (r["success"], r["reward"]) for r in x.finished} for x in (a, b))
    a_fmt, b_fmt = ({(r["repeat"], r["task"]): r.get("malformed", 0) for r in x.finished} for x in (a, b))
    p = paired_outcomes(a_by, b_by, seed=seed)
    fixed, regressed = fixed_and_regressed(a_by, b_by)
    n = p["pairs"]
    return {"pairs": n, "success_diff": (p["a_only"] - p["b_only"]) / n if n else None, "a_only": p["a_only"],
            "b_only": p["b_only"], "mcnemar_p": p["mcnemar_p"],
            "reward_diff": p["reward_diff"] if n else None,
            "reward_diff_ci95": p["reward_diff_ci95"] if n else None, "bootstrap_seed": seed,
            "format_task": format_and_task(a_by, b_by, a_fmt, b_fmt),
            # per (repeat, task): what A solves that B does not, and the reverse
            "fixed": [list(k) for k in fixed], "regressed": [list(k) for k in regressed]}


def evaluate(cfg: QuaeroConfig, specs: list[str | None], plan: EvalPlan) -> tuple[Path, dict]:
    """Evaluate one contestant, or two on identical episodes (then the paired difference). Writes
    `transcripts[-a|-b].jsonl`, `summary.json` and `env-servers/` (local servers' logs) into the eval folder;
    returns (folder, summary)."""
    from quaero.openenv_client import open_envs
    from quaero.openenv_client.tasks import check_splits

    for option, value in (("--tasks", plan.tasks), ("--seeds", plan.seeds), ("--pass-k", plan.pass_k)):
        if type(value) is not int or value < 1:
            raise EvalError(f"{option} {value}: at least 1 (an eval of no episode reports nothing)")
    n_sessions = max(1, min(plan.tasks, cfg.rollout.tasks_per_step * cfg.rollout.group_size))
    transcripts = ["transcripts.jsonl"] if len(specs) == 1 else ["transcripts-a.jsonl", "transcripts-b.jsonl"]
    kept: list[list[dict]] = [[] for _ in specs]
    with contextlib.ExitStack() as scratch:
        who = [resolve(s, cfg, scratch) for s in specs]
        if cfg.sampler.backend == "auto" and any(w.folder is not None and is_adapter(w.folder) for w in who):
            # hf is the sampler that runs an adapter (merged at load); every contestant samples alike
            cfg = _with(cfg, "sampler", backend="hf")
        home = who[0].home if len(who) == 1 else cfg.run_dir
        out = Path(plan.out) if plan.out else home / f"eval-{plan.stamp}"
        _writable_folder(out, "--out" if plan.out else "the eval folder")
        try:
            # logs beside the results
            with open_envs(cfg.env, n_sessions, log_dir=out / names.ENV_SERVERS) as pool:
                check_splits(pool.tasks, _with(cfg, "env", eval_split=plan.split).env, train=False,
                             evaluate=True)
                results = [run_contestant(cfg, w, pool, plan, kept=k) for w, k in zip(who, kept)]
        finally:  # an interrupted or failed eval keeps the episodes that finished
            for name, records in zip(transcripts, kept):
                if records:
                    _write_jsonl(out / name, records)
    summary = {"config": {"split": plan.split, "tasks": plan.tasks, "seeds": plan.seeds,
                          "greedy": plan.greedy, "pass_k": plan.pass_k, "run_seed": cfg.run.seed},
               "results": [r.summary() for r in results]}
    if len(results) == 2:
        summary["paired"] = paired(*results, seed=cfg.run.seed)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return out, summary


def pooled_line(outs: dict[str, Path], seed: int = 0) -> str | None:
    """A mixture's A - B over every env's paired episodes (each env's `--compare` eval folder in `outs`),
    keyed by (env, repeat, task) so two envs' task numbers never pair; None when a folder lacks a side."""
    sides: list[dict] = [{}, {}]
    for env, out in outs.items():
        for side, name in zip(sides, ("transcripts-a.jsonl", "transcripts-b.jsonl")):
            path = out / name
            if not path.exists():
                return None
            for line in path.read_text(encoding="utf-8").splitlines():
                r = json.loads(line)
                if not r["dropped"]:
                    side[(env, r["repeat"], r["task"])] = (r["success"], r["reward"])
    p = paired_outcomes(*sides, seed=seed)
    if not p["pairs"]:
        return None
    ci = p["reward_diff_ci95"]
    success = (p['a_only'] - p['b_only']) / p['pairs']
    return (f"pooled over {len(outs)} envs, A - B on {p['pairs']} paired episodes: success "
            f"{success:+.3f} (A only {p['a_only']}, B only {p['b_only']}; McNemar "
            f"exact p = {p['mcnemar_p']:.4g}), reward {_num(p['reward_diff'], '+.3f')} (paired bootstrap 95% "
            f"{_num(ci[0], '+.3f')} to {_num(ci[1], '+.3f')})")


def _writable_folder(out: Path, what: str) -> None:
    """`out` is a folder this process can write (created if missing), checked before any episode runs."""
    if out.exists() and not out.is_dir():
        raise EvalError(f"{what} {out}: a file, not a folder; name a new folder for the transcripts")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise EvalError(f"{what} {out}: cannot write there ({e.strerror or e}); choose a writable folder "
                        "(--out DIR)") from None


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")


# ── the report ──────────────────────────────────────────────────────────────────────────────────────

def _num(x, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def pass_line(p: dict) -> str:
    """The pass@k line of `quaero eval` and `quaero review` (quaero/telemetry/heldout.py's figures)."""
    return (f"pass@k, k = {p['k']} samples per task at the sampler's temperature, {p['tasks']} tasks: pass@1 "
            f"{_num(p['pass_at_1'])}, pass@{p['k']} {_num(p['pass_at_k'])} (s.e. {_num(p['pass_at_k_se'])})")


def tasks_text(keys: list, limit: int = 30) -> str:
    """A task list for one line: every key up to `limit`, then how many more."""
    if not keys:
        return "none"
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return f"{len(keys)}: " + ", ".join(str(k) for k in keys[:limit]) + more


def report_lines(summary: dict, out: Path) -> list[str]:
    c = summary["config"]
    mode = "greedy" if c["greedy"] else "sampled"
    if c.get("pass_k", 1) > 1:
        mode += f", then {c['pass_k']} sampled per task for pass@k"
    lines = [f"eval on split {c['split']!r}: {c['tasks']} tasks x {c['seeds']} seed(s), {mode}"]
    tags = ["A ", "B "] if len(summary["results"]) == 2 else [""]
    for tag, s in zip(tags, summary["results"]):
        low, high = s["success_ci95"]
        lines.append(f"{tag}{s['model']}: success {s['successes']}/{s['finished']} = "
                     f"{_num(s['success_rate'])} (s.e. {_num(s.get('success_se'))}, Wilson 95% {low:.3f}-"
                     f"{high:.3f}), reward {_num(s['reward_mean'])}, turns {_num(s['turns_mean'], '.2f')}, "
                     f"malformed actions {s['malformed_actions']}, well-formed episodes "
                     f"{_num(s.get('well_formed'))}, dropped {s['dropped']}")
        if s.get("format_failures") is not None:
            lines.append(f"{tag}failures: {_num(s['format_failures'])} format (a malformed action), "
                         f"{_num(s['wrong_answers'])} wrong answers (every action well formed)")
        if s.get("pass_at_k"):
            lines.append(f"{tag}{pass_line(s['pass_at_k'])}")
    p = summary.get("paired")
    if p:
        ci = p["reward_diff_ci95"] or [None, None]
        lines.append(f"A - B on {p['pairs']} paired episodes: success {_num(p['success_diff'], '+.3f')} "
                     f"(A only {p['a_only']}, B only {p['b_only']}; McNemar exact p = {p['mcnemar_p']:.4g}), "
                     f"reward {_num(p['reward_diff'], '+.3f')} (paired bootstrap 95% {_num(ci[0], '+.3f')} "
                     f"to {_num(ci[1], '+.3f')})")
        if p.get("format_task"):
            lines.append(f"B -> A, {format_task_line(p['format_task'], 'in A', 'in B')}")
        if "fixed" in p:
            one = c["seeds"] == 1  # then the task alone names the episode

            def keys(ks: list) -> list:
                return [k[1] if one else tuple(k) for k in ks]

            lines.append(f"B -> A per task{'' if one else ' (repeat, task)'}: fixed (A only) "
                         f"{tasks_text(keys(p['fixed']))}; regressed (B only) "
                         f"{tasks_text(keys(p['regressed']))}")
    lines.append(f"transcripts and summary.json in {out}")
    return lines
