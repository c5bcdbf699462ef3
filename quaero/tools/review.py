"""`quaero review RUN_DIR`'s reading: a run's events.jsonl into its typed summary (the command, its table,
checks and plots: quaero/tools/review_command.py).

Works on a finished run, a resumed run (a step that was re-run after a resume counts once: the
latest record wins) and a run that crashed halfway (a torn last line is skipped). A line it cannot
read (not UTF-8, not a JSON object, a train/eval event whose step is not an integer) is left out and
counted; a file with no readable line is an error. The checks and the metric names they read live in
quaero/telemetry/proofs.py.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from quaero.telemetry import names, proofs
from quaero.telemetry.runlog import read_events
from quaero.telemetry.summary import (
    Comparison,
    ConfigChange,
    EnvFigures,
    Guidance,
    RunRecord,
    RunSummary,
    policy_loss_figures,
)
from quaero.tools.display import MAX_CELL, MAX_LINE, MAX_MAGNITUDE, clip, finite_number
from quaero.tools.display import cell as _fmt
from quaero.tools.memory_growth import rss_growth


class ReviewError(Exception):
    """A run that cannot be reviewed; the message is one line naming the path and the fix."""


def load_run(run_dir: str | Path) -> RunRecord:
    """The run folder's (or the file's) events, read for review: a `ReviewError` where there is none."""
    path = Path(run_dir)
    path = path if path.is_file() else path / names.EVENTS  # the run folder, or its events file itself
    if not path.exists():
        raise ReviewError(f"{path}: no events.jsonl here; pass the run folder, e.g. runs/toolbench")
    try:
        events, unreadable = read_events(path)
    except OSError as e:
        raise ReviewError(f"{path}: cannot read it ({e.strerror or e}); pass the run folder holding a "
                          "readable events.jsonl") from None
    if not events:
        raise ReviewError(f"{path}: no readable event in {unreadable} line(s) (not UTF-8 or not JSON "
                          "objects); pass the events.jsonl a quaero run wrote")
    steps: dict[tuple, dict] = {}
    evals: dict[int, dict] = {}
    for e in events:
        kind = e.get("event")
        if kind not in (names.TRAIN_STEP_EVENT, names.EVAL_EVENT):
            continue
        step, phase = e.get("step"), e.get(names.PHASE, names.PHASE_RL)
        if not _is_int(step) or step < 0 or not isinstance(phase, str):
            unreadable += 1  # cannot be placed on the step axis
        elif kind == names.TRAIN_STEP_EVENT:
            steps[(phase, step)] = e  # a re-run step after resume: latest wins
        else:
            evals[step] = e
    ordered = sorted(steps.values(), key=lambda e: (e["step"],
                                                    e.get(names.PHASE) not in names.WARM_START_PHASES))
    return RunRecord(path=str(path), events=events, steps=ordered, evals=[evals[k] for k in sorted(evals)],
                     unreadable=unreadable, ended=any(e.get("event") == names.RUN_END_EVENT for e in events))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and abs(v) < MAX_MAGNITUDE


def _sum(records: list[dict], key: str) -> int | float:
    return sum(v for r in records if (v := finite_number(r.get(key))) is not None)


def _last(steps: list[dict], key: str, default: Any = None) -> Any:
    for s in reversed(steps):
        if key in s:
            return s[key]
    return default


def _series(records: list[dict], key: str) -> list[float]:
    return [float(v) for r in records if (v := finite_number(r.get(key))) is not None]


def _head_tail(values: list[float], k: int = 3) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    k = max(1, min(k, len(values) // 2 or 1))
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def eval_outcomes(e: dict, env: str | None = None) -> dict[Any, tuple[int, float]] | None:
    """{task: (success, reward)} of an eval event's per-task results, or None when it has none readable. A
    mixture's entries end with their env's name: the task is then "env:index", or the index alone when `env`
    picks that env's entries."""
    out = {}
    for item in e.get(names.EVAL_RESULTS) or []:
        if not (isinstance(item, list) and len(item) in (3, 4) and _is_int(item[0])
                and (r := finite_number(item[2])) is not None):
            continue
        if (key := _task_key(item, env)) is not None:
            out[key] = (int(bool(item[1])), float(r))
    return out or None


def _task_key(item: list, env: str | None) -> Any:
    """A per-task entry's key ([index, ...(, env)]): the index, or "env:index" for a mixture's entry read
    pooled; None for another env's entry when `env` picks one."""
    tag = item[3] if len(item) == 4 else None
    if env is not None and tag != env:
        return None
    return item[0] if tag is None or env is not None else f"{tag}:{item[0]}"


def eval_formats(e: dict, env: str | None = None) -> dict[Any, int] | None:
    """{task: malformed actions} of an eval event's per-task formats (`eval_formats`), keyed as
    `eval_outcomes` keys its results; None when it has none readable (a run from before them)."""
    out = {}
    for item in e.get(names.EVAL_FORMATS) or []:
        if not (isinstance(item, list) and len(item) in (3, 4) and all(_is_int(v) for v in item[:3])):
            continue
        if (key := _task_key(item, env)) is not None:
            out[key] = int(item[1])
    return out or None


def held_out(e: dict, env: str | None = None) -> dict[str, Any]:
    """An eval event's held-out figures: `success` and its standard error `success_se`, `format_failures`
    and `wrong_answers` (shares of its episodes), and, where it sampled pass@k, `pass_k`, `pass_tasks` (those
    pass@k counted), `pass_at_1`, `pass_at_k`, `pass_at_k_se`. Read from its per-task lists (`eval_results`,
    `eval_formats`, `eval_pass_results`; `env` picks a mixture's env), else from its pooled fields (a run
    from before the lists); a figure it carries neither way is left out."""
    from quaero.telemetry.heldout import held_out_figures, pass_figures

    out: dict[str, Any] = {}
    outcomes, formats = eval_outcomes(e, env), eval_formats(e, env)
    if outcomes:
        keys = list(outcomes)
        out["success"] = sum(outcomes[k][0] for k in keys) / len(keys)
        figures = held_out_figures([outcomes[k][0] for k in keys],
                                   [formats.get(k, 0) for k in keys] if formats else [0] * len(keys))
        out["success_se"] = figures["success_se"]
        if formats and all(k in formats for k in keys):
            out.update(format_failures=figures["format_failures"], wrong_answers=figures["wrong_answers"])
    elif env is None:
        for key, name in (("success", names.EVAL_SUCCESS_RATE), ("success_se", names.EVAL_SUCCESS_SE),
                          ("format_failures", names.EVAL_FORMAT_FAILURES),
                          ("wrong_answers", names.EVAL_WRONG_ANSWERS)):
            if (v := finite_number(e.get(name))) is not None:
                out[key] = v
    k = e.get(names.EVAL_PASS_K)
    samples = [(c, n) for item in e.get(names.EVAL_PASS_RESULTS) or []
               if isinstance(item, list) and len(item) in (3, 4) and all(_is_int(v) for v in item[:3])
               and 0 <= (c := item[1]) <= (n := item[2]) and _task_key(item, env) is not None]
    if _is_int(k) and k > 1 and samples:
        p = pass_figures(samples, k)
        out.update(pass_k=k, pass_tasks=p["tasks"],
                   **{key: p[key] for key in ("pass_at_1", "pass_at_k", "pass_at_k_se")})
    return out


def held_out_by(e: dict, which: str) -> dict[Any, tuple[float, float]]:
    """{group or difficulty: (success, its standard error)} of an eval event's tasks, `which` "group" or
    "difficulty" as its `eval_task_groups` name each task ([index, group, difficulty(, env)]); {} where it
    names none (an env without a Task API, a run from before the field)."""
    from quaero.telemetry.heldout import standard_error

    outcomes, column = eval_outcomes(e) or {}, {"group": 1, "difficulty": 2}[which]
    parts: dict[Any, list[float]] = {}
    for item in e.get(names.EVAL_TASK_GROUPS) or []:
        if (isinstance(item, list) and len(item) in (3, 4) and _is_int(item[0])
                and (key := _task_key(item, None)) in outcomes
                and isinstance(item[column], (str, int, float))):
            parts.setdefault(item[column], []).append(float(outcomes[key][0]))
    return {v: (sum(xs) / len(xs), standard_error(xs)) for v, xs in parts.items()}


def _nonfinite_rewards(e: dict) -> bool:
    """Whether an eval event's per-task results hold a reward that is not finite: NaN or inf, which the run
    log writes as null (or as such, in a foreign writer's file)."""
    return any(isinstance(item, list) and len(item) == 3 and (item[2] is None or isinstance(item[2], float)
                                                               and not math.isfinite(item[2]))
               for item in e.get(names.EVAL_RESULTS) or [])


def env_names(run: RunRecord) -> list[str]:
    """A mixture run's env names (from its steps' `by_env` and evals' `eval_by_env`), in first-seen order."""
    seen: dict[str, None] = {}
    for r in run.steps + run.evals:
        for key in (names.BY_ENV, names.EVAL_BY_ENV):
            if isinstance(r.get(key), dict):
                seen.update(dict.fromkeys(str(k) for k in r[key]))
    return list(seen)


def per_env(run: RunRecord) -> dict[str, EnvFigures]:
    """A mixture's figures per env: its RL groups, those with signal, its generated tokens and lost episodes,
    its last eval's success rate, and its "RL improved eval over warm start"."""
    rl = [s for s in run.steps if s.get(names.PHASE, names.PHASE_RL) == names.PHASE_RL]
    out = {}
    for env in env_names(run):
        mine = [s[names.BY_ENV][env] for s in rl if isinstance(s.get(names.BY_ENV), dict)
                and isinstance(s[names.BY_ENV].get(env), dict)]
        signal, tokens = _sum(mine, names.SIGNAL_GROUPS), _sum(mine, names.GENERATED_TOKENS)
        evals = [e[names.EVAL_BY_ENV][env] for e in run.evals if isinstance(e.get(names.EVAL_BY_ENV), dict)
                 and isinstance(e[names.EVAL_BY_ENV].get(env), dict)]
        out[env] = EnvFigures(
            groups=_sum(mine, names.GROUPS), signal_groups=signal, generated_tokens=tokens,
            signal_groups_per_1k_tokens=round(1000 * signal / tokens, 4) if tokens else None,
            episodes_lost=_sum(mine, names.EPISODES_LOST),
            eval_success_last=evals[-1].get(names.EVAL_SUCCESS_RATE) if evals else None,
            rl_vs_warm_start=rl_over_warm_start(run, env))
    return out


def env_line(env: str, f: EnvFigures) -> str:
    """`quaero review`'s line for one env of a mixture."""
    c = f.rl_vs_warm_start
    rl = (f"RL over warm start {c.warm_start_success:.3f} -> {c.end_success:.3f} on {c.pairs} tasks "
          f"(+{c.improved}/-{c.worsened}, McNemar p {c.mcnemar_p:.3g})" if not c.why
          else f"RL over warm start: {c.why}")
    return clip(f"env {_fmt(env)}: {f.groups} RL groups, {f.signal_groups} with signal "
                f"({_fmt(f.signal_groups_per_1k_tokens)} per 1k generated tokens), "
                f"{f.episodes_lost} episodes lost, last eval success {_fmt(f.eval_success_last)}; {rl}",
                MAX_LINE)


def rl_over_warm_start(run: RunRecord, env: str | None = None) -> Comparison:
    """The last eval after RL against the eval at the end of the warm start, paired on the tasks both
    finished: McNemar exact p on success, paired bootstrap 95% interval of the reward difference (end - warm
    start). `why` says what is missing when there is nothing to compare, or that an eval was guided: RL is
    judged on the policy's own, unguided greedy episodes only (`unguided`: both evals counted 0 guided
    tokens)."""
    from quaero.tools.significance import fixed_and_regressed, format_and_task, paired_outcomes

    warm = sft_span(run)
    rl = [s["step"] for s in run.steps if s.get(names.PHASE, names.PHASE_RL) == names.PHASE_RL]
    if not warm or not rl:
        return Comparison("no warm start" if not warm else "no RL step")
    warm_end = warm[1]
    start = next((e for e in run.evals if e["step"] == warm_end), None)
    end = next((e for e in reversed(run.evals) if e["step"] > warm_end), None)
    if start is None or end is None:
        return Comparison(f"no eval at the warm start's last step {warm_end}" if start is None
                          else "no eval after RL")
    guided = [e for e in (start, end) if (finite_number(e.get(names.EVAL_GUIDED_TOKENS)) or 0) > 0]
    if guided:
        return Comparison(f"the eval at step {guided[0]['step']} has {guided[0][names.EVAL_GUIDED_TOKENS]} "
                          "guided tokens: not the policy's own episodes, so RL is not judged on it")
    unguided = all(names.EVAL_GUIDED_TOKENS in e for e in (start, end)) or None
    a, b = eval_outcomes(end, env), eval_outcomes(start, env)
    if a is None or b is None:
        nonfinite = [e["step"] for e in (start, end) if _nonfinite_rewards(e)]
        if nonfinite:
            steps = ", ".join(map(str, nonfinite))
            return Comparison(f"the eval rewards of step(s) {steps} are not finite (NaN or inf, null in "
                              "eval_results): the env's rewards cannot be compared")
        return Comparison("the evals carry no per-task results (eval_results)")
    p = paired_outcomes(a, b)
    if not p["pairs"]:
        return Comparison("the two evals share no task")
    fa, fb = eval_formats(end, env), eval_formats(start, env)
    split = format_and_task(a, b, fa, fb) if fa and fb else None
    fixed, regressed = fixed_and_regressed(a, b)
    return Comparison("", warm_start_step=warm_end, end_step=end["step"], pairs=p["pairs"],
                      warm_start_success=p["b_success"], end_success=p["a_success"], improved=p["a_only"],
                      worsened=p["b_only"], mcnemar_p=p["mcnemar_p"], reward_diff=p["reward_diff"],
                      reward_diff_ci95=p["reward_diff_ci95"], unguided=unguided, format_task=split,
                      fixed=fixed, regressed=regressed)


def guidance_of(rl: list[dict]) -> Guidance | None:
    """The RL steps' guided share (None when none guided or was scheduled to)."""
    if not any(st.get(names.GUIDANCE_MEMBERS) or st.get(names.GROUPS_GUIDED) for st in rl):
        return None
    return Guidance(*(_sum(rl, k) for k in (
        names.GROUPS, names.GROUPS_GUIDED, names.SIGNAL_GROUPS, names.SIGNAL_GROUPS_GUIDED,
        names.GUIDED_MEMBERS, names.GUIDED_MEMBERS_SUCCEEDED, names.GUIDED_MEMBERS_DROPPED,
        names.GUIDED_ACTION_TOKENS, names.ONPOLICY_ACTION_TOKENS)))


def guidance_line(g: Guidance, c: Comparison) -> str:
    """How much of RL's signal came from guidance, and what the RL-over-warm-start check judged."""
    def share(part: float, whole: float) -> str:
        return f"{part} of {whole}" + (f" ({part / whole:.0%})" if whole else "")

    if c.why:
        judged = f"not judged: {c.why}"
    elif c.unguided:
        judged = "judged on unguided greedy evals (eval_guided_tokens = 0 in both)"
    else:
        judged = "judged on greedy evals, which never guide (these logged no eval_guided_tokens)"
    return clip(f"guidance: {share(g.groups_guided, g.groups)} RL groups guided ({g.guided_members} members, "
                f"{g.guided_members_succeeded} succeeded, {g.guided_members_dropped} dropped); "
                f"{share(g.signal_groups_guided, g.signal_groups)} groups with signal were guided; "
                f"{share(g.guided_action_tokens, g.guided_action_tokens + g.onpolicy_action_tokens)} trained "
                f"action tokens a guide's; RL over warm start {judged}", MAX_LINE)


def summarize(run: RunRecord) -> RunSummary:
    steps, evals = run.steps, run.evals
    rl = [s for s in steps if s.get(names.PHASE, names.PHASE_RL) == names.PHASE_RL]
    # a step without ECHO targets logs echo_loss 0: not a point of the ECHO learning curve
    echo_first, echo_last = _head_tail(
        _series([st for st in steps if st.get(names.ECHO_TOKENS, 1)], names.ECHO_LOSS)
    )
    rl_first, rl_last = _head_tail(_series(rl, names.RL_LOSS))
    rew_first, rew_last = _head_tail(_series(rl, names.REWARD_MEAN))
    eval_rewards = _series(evals, names.EVAL_REWARD)
    untrained = [e for e in evals if e.get("step") == 0]
    times = _series(steps, names.STEP_TIME_S)
    transfers = sorted({str(r[names.WEIGHT_TRANSFER]) for r in steps + evals if r.get(names.WEIGHT_TRANSFER)})
    return RunSummary(
        steps=len(steps),
        sft_steps=len(steps) - len(rl),
        rl_steps=len(rl),
        last_step=steps[-1].get("step") if steps else None,
        finished=run.ended,
        unreadable_lines=run.unreadable,
        train_reward_first=rew_first,
        train_reward_last=rew_last,
        train_success_last=_last(rl, names.SUCCESS_RATE),
        eval_reward_baseline=_last(untrained, names.EVAL_REWARD),
        eval_reward_last=eval_rewards[-1] if eval_rewards else None,
        eval_success_last=evals[-1].get(names.EVAL_SUCCESS_RATE) if evals else None,
        rl_loss_first=rl_first,
        rl_loss_last=rl_last,
        echo_loss_first=echo_first,
        echo_loss_last=echo_last,
        rows=_sum(steps, names.ROWS),
        **_trained_tokens(steps),
        **_rl_totals(rl),
        row_tokens=_sum(steps, names.ROW_TOKENS),
        step_time_median_s=statistics.median(times) if times else None,
        **_peaks(run),
        env_retries=_sum(steps, names.ENV_RETRIES),
        episodes_dropped=_sum(steps, names.EPISODES_DROPPED),
        episodes_ended_at_reset=_sum(steps, names.EPISODES_ENDED_AT_RESET),
        env_rejected_actions=_sum(steps, names.ENV_REJECTED_ACTIONS),
        malformed_actions=_sum(steps, names.MALFORMED_ACTIONS),
        bridge_fallbacks=_sum(steps + evals, names.BRIDGE_FALLBACKS),
        prefix_mismatches=_sum(steps + evals, names.PREFIX_MISMATCHES),
        rows_packed=_sum(steps, names.ROWS_PACKED),
        rows_transition=_sum(steps, names.ROWS_TRANSITION),
        **_gap_figures(rl),
        weight_transfer=",".join(transfers) or None,
        policy_staleness_max=max(_series(rl, names.POLICY_STALENESS), default=None),
        clip_fraction_max=max(_series(rl, names.CLIP_FRACTION), default=None),
        policy_loss=policy_loss_figures(rl),
        selective=_selective(steps),
        rl_vs_warm_start=rl_over_warm_start(run),  # paired per task
        per_env=per_env(run),
        resumed_with_changed_config=resumes_changed(run),  # quaero/recipe/train.py _note_changed_config
        guidance=guidance_of(rl),
        rss_growth=rss_growth(steps),
        evals_start_at=evals[0].get("step") if evals and not untrained else None,
        eval_last={f"eval_{k}_last" if k != "pass_k" else "eval_pass_k": v
                   for k, v in held_out(evals[-1]).items() if k != "success"} if evals else {},
    )


def _trained_tokens(steps: list[dict]) -> dict:
    """The action and ECHO tokens the run trained: only on steps whose update reached the weights."""
    updated = [st for st in steps if proofs.updated_weights(st)]
    return {"action_tokens": _sum(updated, names.ACTION_TOKENS),
            "echo_tokens": _sum(updated, names.ECHO_TOKENS)}


def _rl_totals(rl: list[dict]) -> dict:
    """The RL steps' totals: those `describe_rl_signal` reads (quaero/telemetry/proofs.py), and the groups
    with a learning signal per generated token."""
    grouped = any(names.GROUPS in st for st in rl)
    # tokens count as trained only on steps whose update reached the weights
    updated = [st for st in rl if proofs.updated_weights(st)]
    signal, generated = _sum(rl, names.SIGNAL_GROUPS), _sum(rl, names.GENERATED_TOKENS)
    return {
        "rl_steps_with_signal": sum(1 for st in updated
                                    if (finite_number(st.get(names.ACTION_TOKENS)) or 0) > 0),
        "rl_steps_without_update": len(rl) - len(updated),
        "rl_action_tokens": _sum(updated, names.ACTION_TOKENS),
        "rl_echo_tokens": _sum(updated, names.ECHO_TOKENS),
        "rl_actions": _sum(rl, names.TURNS),
        "rl_valid_actions": _sum(rl, names.TURNS) - _sum(rl, names.MALFORMED_ACTIONS),
        "rl_env_rejected_actions": _sum(rl, names.ENV_REJECTED_ACTIONS),
        "rl_episodes_ended_at_reset": _sum(rl, names.EPISODES_ENDED_AT_RESET),
        "rl_episodes_dropped": _sum(rl, names.EPISODES_DROPPED),
        "rl_groups": _sum(rl, names.GROUPS) if grouped else None,
        "rl_groups_zero_advantage": _sum(rl, names.GROUPS_ZERO_ADVANTAGE) if grouped else None,
        "rl_signal_groups": signal,
        "rl_generated_tokens": generated,
        "rl_signal_groups_per_1k_tokens": round(1000 * signal / generated, 4) if generated else None,
    }


def _peaks(run: RunRecord) -> dict:
    """Each phase's peak memory over the run."""
    steps, evals = run.steps, run.evals
    return {
        "peak_mem_mb": max(_series(steps, names.PEAK_MEM_MB), default=None),
        "rollout_peak_mem_mb": max(_series(steps, names.ROLLOUT_PEAK_MEM_MB), default=None),
        "weight_sync_peak_mem_mb": max(_series(steps, names.WEIGHT_SYNC_PEAK_MEM_MB), default=None),
        "process_peak_mem_mb": max(_series(steps, names.PROCESS_PEAK_MEM_MB), default=None),
        "eval_peak_mem_mb": max(_series(evals, names.EVAL_PEAK_MEM_MB), default=None),
        "checkpoint_peak_mem_mb": max(_series(run.of_kind(names.CHECKPOINT_SAVED_EVENT,
                                                          names.CHECKPOINT_READ_EVENT), names.PEAK_MEM_MB),
                                   default=None),
    }


def _gap_figures(rl: list[dict]) -> dict:
    """The sampler's log-prob gap: over the RL steps, and over the on-policy ones (no staleness)."""
    onpolicy = [st for st in rl if not st.get(names.POLICY_STALENESS)
                and finite_number(st.get(names.SAMPLER_LOGPROB_GAP_MAX)) is not None]
    return {
        "sampler_logprob_gap_max": max(_series(rl, names.SAMPLER_LOGPROB_GAP_MAX), default=None),
        "onpolicy_gap_steps": len(onpolicy),
        "onpolicy_logprob_gap_max": max(_series(onpolicy, names.SAMPLER_LOGPROB_GAP_MAX), default=None),
        "onpolicy_logprob_gap_mean_max": max(_series(onpolicy, names.SAMPLER_LOGPROB_GAP_MEAN), default=None),
    }


def _selective(steps: list[dict]) -> dict:
    """The selective LM head's figures: its last settings and the branch counters' sums; tree training's
    setting, counters' sums and latest fallback reason (trainers/tree.py)."""
    reasons = [st for st in steps if st.get(names.COMPILE_FALLBACK_REASON)]
    tree_reasons = [st for st in steps if st.get(names.TREE_FALLBACK_REASON)]
    return {
        names.SELECTIVE_SUFFIX_LOGITS: _last(steps, names.SELECTIVE_SUFFIX_LOGITS),
        names.COMPILE_MODE: _last(steps, names.COMPILE_MODE, ""),
        # the latest reason given (a step with no targets attempts no compile and gives none)
        names.COMPILE_FALLBACK_REASON: _last(reasons, names.COMPILE_FALLBACK_REASON, ""),
        **{k: _sum(steps, k) for k in proofs.BRANCH_COUNTERS},
        names.TREE_PACKING: _last(steps, names.TREE_PACKING, "off"),
        **{k: _sum(steps, k) for k in proofs.TREE_COUNTERS},
        names.TREE_FALLBACK_REASON: _last(tree_reasons, names.TREE_FALLBACK_REASON, ""),
    }


def resumes_changed(run: RunRecord) -> dict[str, ConfigChange]:
    """Each resume under a changed config, by its checkpoint step."""
    out = {}
    for e in run.of_kind(names.RESUME_CONFIG_CHANGED_EVENT):
        if not isinstance(e.get("changes"), dict):
            continue  # a hand-edited line is not the run's to repeat
        changes = {str(k): v for k, v in e["changes"].items() if isinstance(v, list) and len(v) == 2}
        trained = e.get("trained")
        out[str(e.get("checkpoint_step"))] = ConfigChange(
            changes, [str(k) for k in trained] if isinstance(trained, list) else [])
    return out


def changed_line(step: str, resumed: ConfigChange) -> str:
    changes = ", ".join(f"{_fmt(k)} {_fmt(a)} -> {_fmt(b)}" for k, (a, b) in resumed.changes.items())
    trained = " (the steps after it train with the new values)" if resumed.trained else ""
    return clip(f"{'warning' if trained else 'note'}: resumed at step {_fmt(step)} with a changed config"
                f"{trained}: {changes}", MAX_LINE)


def render_table(rows: list[tuple[str, list[Any]]], header: list[str]) -> str:
    """The rows in columns: an event's cell clipped at MAX_CELL, the header (`--compare`'s run folders: the
    command line's own words) only at MAX_LINE, so two runs stay told apart."""
    cells = [[clip(h, MAX_LINE) for h in header]] + [[clip(k, MAX_CELL)] + [_fmt(v) for v in vs]
                                                       for k, vs in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def sft_span(run: RunRecord) -> tuple[int, int] | None:
    """First and last warm-start (SFT) step, shaded on every plot so the two phases read apart."""
    sft = [s["step"] for s in run.steps if s.get(names.PHASE) in names.WARM_START_PHASES]
    return (min(sft), max(sft)) if sft else None
