"""The proofs read from a run's metrics (their names are declared in quaero/telemetry/names.py).

The trainer step counts its branches with `BRANCH_COUNTERS`; `quaero review`, `quaero bench` and CI
judge a run with the checks below (`quaero review RUN --require NAME`). Adding a branch counter is its
name in names.py and one line in `BRANCH_COUNTERS`; every list of names elsewhere derives from them. No
torch here: `trainers/` imports this module.

A check is a `Check`: its name, status "pass" | "fail" | "n/a" (the check does not apply to this run,
`detail` says why), `passed` True | False | None to match, `required` whether `--require-proof` counts it;
`to_dict` is what `--json` and the bench results write.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from quaero.telemetry.names import (
    ACTION_TOKENS,
    CHUNKED_BATCHES,
    COMPILE_FALLBACK_REASON,
    COMPILE_MODE,
    COMPILED_CE_BATCHES,
    DENSE_BATCHES,
    ECHO_TOKENS,
    ENV_REJECTED_ACTIONS,
    EPISODES_DROPPED,
    EPISODES_ENDED_AT_RESET,
    FALLBACK_BATCHES,
    FORWARD_PASSES,
    FORWARD_PASSES_PER_MICROBATCH,
    GROUPS,
    GROUPS_ZERO_ADVANTAGE,
    HIDDEN_BATCHES,
    LM_HEAD_SKIPPED_MICROBATCHES,
    MICROBATCHES,
    OPTIMIZER_STEPS,
    RL_ACTIONS,
    RL_STEPS,
    RL_STEPS_WITH_SIGNAL,
    RL_STEPS_WITHOUT_UPDATE,
    RL_VALID_ACTIONS,
    SELECTIVE_SUFFIX_LOGITS,
    SPARSE_SUFFIX_SKIPS,
    SUFFIX_BATCHES,
    TREE_BATCHES,
    TREE_FALLBACK_BATCHES,
    TREE_FALLBACK_REASON,
    TREE_PACKING,
    TREE_ROW_TOKENS,
    TREE_UNIQUE_TOKENS,
)
from quaero.telemetry.summary import Comparison, RunSummary

# Each branch counter and the microbatches it counts, read from a `trainers.selective.SelectiveInfo`.
# Per step these are microbatch counts; review sums them over steps.
BRANCH_COUNTERS: dict[str, Callable[[Any], bool]] = {
    SPARSE_SUFFIX_SKIPS: lambda info: info.sparse_suffix_skip,  # the suffix shortcut was declined
    HIDDEN_BATCHES: lambda info: info.branch in ("hidden", "hidden_chunked", "compiled"),
    COMPILED_CE_BATCHES: lambda info: info.compiled,
    SUFFIX_BATCHES: lambda info: info.branch == "suffix",
    FALLBACK_BATCHES: lambda info: info.branch == "fallback",  # selective asked for, full logits ran
    CHUNKED_BATCHES: lambda info: info.branch == "hidden_chunked",
    DENSE_BATCHES: lambda info: info.branch == "dense",  # selective off
}

# The tree-packing counters (trainers/tree.py), summed over steps like the branch counters.
TREE_COUNTERS = (TREE_BATCHES, TREE_UNIQUE_TOKENS, TREE_ROW_TOKENS, TREE_FALLBACK_BATCHES)

# What one trainer step's proof reads: its branch metrics and the shared-forward figures.
STEP_PROOF_METRICS = (SELECTIVE_SUFFIX_LOGITS, *BRANCH_COUNTERS, COMPILE_MODE, COMPILE_FALLBACK_REASON,
                      FORWARD_PASSES, MICROBATCHES, FORWARD_PASSES_PER_MICROBATCH,
                      LM_HEAD_SKIPPED_MICROBATCHES)


def short(metric: str) -> str:
    """A branch metric without its `local_train_selective_` prefix (labels, details)."""
    return metric.removeprefix("local_train_selective_")


PASS, FAIL, NA = "pass", "fail", "n/a"
SPARSE_ECHO = "sparse ECHO proof"
COMPILED_CE = "compiled CE proof"
TREE_TRAINING = "tree training proof"
EXACT_ROWS = "exact rows (prefix mismatches)"
TRAINED = "trained at least one step"
ECHO_FALLING = "ECHO loss falling"
EVAL_ABOVE_UNTRAINED = "eval reward above untrained"
RL_TRAINED = "RL trained (action tokens with advantage)"
ECHO_TRAINED = "ECHO trained (env tokens)"
LOGPROB_GAP = "sampler log-probs agree with the trainer"
RL_KEPT = "RL kept eval at warm start"
RL_IMPROVED = "RL improved eval over warm start"
MEMORY_FLAT = "process memory flat"
CHECKS = (SPARSE_ECHO, COMPILED_CE, TREE_TRAINING, EXACT_ROWS, TRAINED, LOGPROB_GAP, RL_TRAINED, ECHO_TRAINED,
          ECHO_FALLING, EVAL_ABOVE_UNTRAINED, RL_KEPT, RL_IMPROVED, MEMORY_FLAT)
# MEMORY_FLAT: in each phase of at least RSS_MIN_STEPS steps, the process's RSS (`process_rss_mb`) after its
# warm-up (its first min(RSS_WARM_UP_STEPS, a fifth of the phase) steps: malloc's caches filled, the sampler
# built) may grow by at most RSS_GROWTH_MAX. A main job whose oracle calls each left a thread behind grew
# 1.4 GB -> 7.1 GB on a 20M-parameter model.
RSS_WARM_UP_STEPS = 100
RSS_MIN_STEPS = 10
RSS_GROWTH_MAX = 0.10
# McNemar exact p on the success pairs, or the reward difference's 95% interval clear of 0: the level at which
# RL_IMPROVED calls a gain and RL_KEPT a loss
RL_IMPROVED_P = 0.05

# |sampler log-prob - trainer log-prob| of a sampled token, on-policy (nats). Measured: fp32 on CPU at most
# 3.4e-4 (benchmarks/HISTORY.md); bf16 kernels differ by a few tenths on a rare token. Past these the
# importance ratios train on noise (a sampler +50 nats off gave ratios of 2e-27 and a clip fraction of 1.0).
LOGPROB_GAP_MAX_NATS = 2.0  # any one token of an on-policy step
LOGPROB_GAP_MEAN_NATS = 0.1  # a step's mean over its sampled tokens
# A sampled token's log-prob above this is impossible (log p <= 0; fp32 rounding stays far below it): the
# episode that holds it is dropped and counted (quaero/rollout/driver.py), never trained on.
MAX_SAMPLER_LOGPROB = 1e-3


@dataclass(frozen=True)
class Check:
    """One check of a run, named as in `CHECKS`: PASS, FAIL or NA (it does not apply; `detail` says why)."""

    name: str
    required: bool  # counted by `--require-proof`
    status: str
    detail: str

    @property
    def passed(self) -> bool | None:
        return {PASS: True, FAIL: False, NA: None}[self.status]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able check `quaero review --json` and the bench results write."""
        return {"name": self.name, "required": self.required, "status": self.status, "passed": self.passed,
                "detail": self.detail}


def _judged(name: str, required: bool, ok: bool, detail: str) -> Check:
    return Check(name, required, PASS if ok else FAIL, detail)


def sparse_echo(totals: Mapping[str, Any]) -> Check:
    """Sparse ECHO rows took the selected-hidden path: skips > 0, hidden > 0, fallback = 0.

    Judged only when some microbatch was sparse (a skip or a hidden batch): rows whose targets are dense
    take the exact suffix branch, which is the right branch for them, so there is nothing to prove; nor is
    there when no microbatch was trained (the "trained at least one step" check fails such a run).
    A fallback batch fails it whatever the rows were."""
    skips, hidden = totals.get(SPARSE_SUFFIX_SKIPS, 0), totals.get(HIDDEN_BATCHES, 0)
    fallback, suffix = totals.get(FALLBACK_BATCHES, 0), totals.get(SUFFIX_BATCHES, 0)
    detail = f"sparse_suffix_skips={skips} > 0, hidden_logprob_batches={hidden} > 0, " \
             f"fallback_logprob_batches={fallback} = 0"
    if fallback == 0 and skips == 0 and hidden == 0 and suffix > 0:
        return Check(SPARSE_ECHO, True, NA, "dense rows took the exact suffix branch: suffix batches "
                                            f"{suffix}")
    if not any(totals.get(name, 0) for name in BRANCH_COUNTERS):
        return Check(SPARSE_ECHO, True, NA, "no microbatch was trained (every branch counter is 0)")
    return _judged(SPARSE_ECHO, True, skips > 0 and hidden > 0 and fallback == 0, detail)


def compiled_ce(totals: Mapping[str, Any]) -> Check:
    """With `train_compile_selective_ce = "require"`: compiled batches > 0 and no fallback reason."""
    mode, compiled = totals.get(COMPILE_MODE, ""), totals.get(COMPILED_CE_BATCHES, 0)
    if mode != "require":
        return Check(COMPILED_CE, True, NA, f"mode={mode!r}: judged only with "
                                            "train_compile_selective_ce='require'")
    reason = totals.get(COMPILE_FALLBACK_REASON, "")
    return _judged(COMPILED_CE, True, compiled > 0 and reason == "",
                   f"mode=require, compiled_ce_batches={compiled} > 0, fallback_reason={reason!r}")


def tree_training(totals: Mapping[str, Any]) -> Check:
    """With `train_tree_packing` on or auto: microbatches ran as tries, with their unique / row tokens; "on"
    fails on any fallback (its reason shown), "auto" counts the microbatches it left as rows as not paying."""
    mode = totals.get(TREE_PACKING, "off")
    if mode in ("off", "", None):
        return Check(TREE_TRAINING, False, NA, "train_tree_packing='off'")
    packed, fallback = totals.get(TREE_BATCHES, 0), totals.get(TREE_FALLBACK_BATCHES, 0)
    unique, rows = totals.get(TREE_UNIQUE_TOKENS, 0), totals.get(TREE_ROW_TOKENS, 0)
    ratio = f"{unique / rows:.3f}" if rows else "n/a"
    detail = (f"mode={mode}, tree_batches={packed} > 0, unique/row tokens {unique}/{rows} = {ratio}, "
              f"tree_fallback_batches={fallback}")
    reason = totals.get(TREE_FALLBACK_REASON, "")
    if reason:
        detail += f" ({reason})"
    if mode == "auto" and packed == 0 and fallback == 0:
        return Check(TREE_TRAINING, False, NA, f"{detail}: no microbatch shared enough to pay")
    return _judged(TREE_TRAINING, False, packed > 0 and (fallback == 0 or mode == "auto"), detail)


def logprob_gap(s: RunSummary) -> Check:
    """On-policy RL steps (rows sampled by the weights being trained: policy_staleness 0) measured a
    sampler-vs- trainer gap within LOGPROB_GAP_MAX_NATS per token and LOGPROB_GAP_MEAN_NATS per step's mean.
    Steps trained on rows sampled ahead are left out: their gap includes the policy's own change."""
    worst, mean, steps = s.onpolicy_logprob_gap_max, s.onpolicy_logprob_gap_mean_max, s.onpolicy_gap_steps
    if not steps or worst is None:
        return Check(LOGPROB_GAP, True, NA, "no on-policy RL step measured a gap (SFT steps sample nothing)")
    return _judged(LOGPROB_GAP, True,
                   worst <= LOGPROB_GAP_MAX_NATS and (mean or 0.0) <= LOGPROB_GAP_MEAN_NATS,
                   f"over {steps} on-policy step(s): max {worst:.3g} <= {LOGPROB_GAP_MAX_NATS:g} nats, worst "
                   f"step mean {mean or 0.0:.3g} <= {LOGPROB_GAP_MEAN_NATS:g} nats")


def branch_checks(totals: Mapping[str, Any]) -> list[Check]:
    """The checks a trainer step's branch counters prove (summed over steps)."""
    return [sparse_echo(totals), compiled_ce(totals), tree_training(totals)]


def run_checks(s: RunSummary) -> list[Check]:
    """Every check of a reviewed run, in `CHECKS` order, from its summary (quaero/tools/review.py
    `summarize`)."""
    rows, tokens = s.rows, s.action_tokens + s.echo_tokens
    trained = s.steps > 0 and rows > 0 and tokens > 0
    untrained = f"0 rows trained (steps={s.steps}, rows={rows}): nothing learned to judge"
    checks = [
        *branch_checks(s.selective),
        _judged(EXACT_ROWS, True, s.prefix_mismatches == 0, f"prefix_mismatches={s.prefix_mismatches} = 0"),
        _judged(TRAINED, True, trained, f"steps={s.steps} > 0, rows={rows} > 0, action+echo "
                                        f"tokens={tokens} > 0"),
        *training_apart(s),
    ]
    checks.append(logprob_gap(s))
    first, last = s.echo_loss_first, s.echo_loss_last
    if first is None:
        checks.append(Check(ECHO_FALLING, False, NA, "no step with ECHO targets"))
    else:
        checks.append(_judged(ECHO_FALLING, False, trained and last < first,
                              f"{first:.4f} -> {last:.4f}" if trained else untrained))
    base, last = s.eval_reward_baseline, s.eval_reward_last
    if last is None:
        checks.append(Check(EVAL_ABOVE_UNTRAINED, False, NA, "no eval event"))
    elif base is None:  # never judged against a later eval that the name would call "untrained"
        checks.append(Check(EVAL_ABOVE_UNTRAINED, False, NA,
                            "no eval of the untrained model (step 0): evals start at step "
                            f"{s.evals_start_at} (a run started from a copied checkpoint)"))
    else:
        checks.append(_judged(EVAL_ABOVE_UNTRAINED, False, trained and last > base,
                              f"{base:.3f} -> {last:.3f}" if trained else untrained))
    checks += [rl_kept(s.rl_vs_warm_start), rl_improved(s.rl_vs_warm_start), memory_flat(s.rss_growth)]
    return checks


def memory_flat(growth: Mapping[str, Mapping[str, Any]]) -> Check:
    """The process's RSS stayed within RSS_GROWTH_MAX of its post-warm-up reading in every phase
    (quaero/tools/memory_growth.py `rss_growth`)."""
    if not growth:
        return Check(MEMORY_FLAT, False, NA, f"no phase of {RSS_MIN_STEPS}+ steps logged `process_rss_mb`")
    said = [f"{phase} {g['reference_rss_mb']:.0f} MiB at step {g['reference_step']} -> "
            f"{g['largest_rss_mb']:.0f} at {g['largest_step']} ({g['growth']:+.0%}"
            + (f"; malloc in use {g['reference_malloc_mb']:.0f} -> {g['largest_malloc_mb']:.0f}"
               if "largest_malloc_mb" in g else "") + ")"
            for phase, g in growth.items()]
    grown = [g for g in growth.values() if g["growth"] > RSS_GROWTH_MAX]
    kept = grown and all("largest_malloc_mb" in g and 2 * (g["largest_malloc_mb"] - g["reference_malloc_mb"])
                         <= g["largest_rss_mb"] - g["reference_rss_mb"] for g in grown)
    why = ("" if not grown else
           ": malloc's memory in use grew by less than half of it, so most of it is memory freed and kept by "
           "the allocator, not memory the process still holds (`quaero bench soak`)" if kept else
           ": the process keeps memory it does not give back (`quaero bench soak`)")
    return _judged(MEMORY_FLAT, False, not grown, "; ".join(said) + f" (at most {RSS_GROWTH_MAX:+.0%}{why})")


def _rl_vs_warm_start(c: Comparison) -> str:
    """The pairs as they are, for both RL checks: each relation stated as it holds, never as a criterion
    reads."""
    low, high = c.reward_diff_ci95
    p_rel = "<" if c.mcnemar_p < RL_IMPROVED_P else ">="
    return (f"steps {c.warm_start_step} -> {c.end_step} on {c.pairs} shared tasks: success "
            f"{c.warm_start_success:.3f} -> {c.end_success:.3f} (solved only after RL "
            f"{c.improved}, only before {c.worsened}; McNemar exact p = {c.mcnemar_p:.3g} {p_rel} "
            f"{RL_IMPROVED_P}), reward {c.reward_diff:+.3f} (paired bootstrap 95% {low:+.3f} to "
            f"{high:+.3f}; {'> 0' if low > 0 else '< 0' if high < 0 else 'spans 0'})"
            + ("; unguided greedy evals" if c.unguided else "")
            + (f"; {format_task_line(c.format_task, 'after RL', 'before')}" if c.format_task else ""))


def format_task_line(c: dict, a: str = "A", b: str = "B") -> str:
    """quaero/tools/significance.py `format_and_task`'s figures in one line, B -> A (as review's warm start
    -> after RL; `quaero eval --compare`'s B -> A)."""
    def rate(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.3f}"

    return (f"format: well-formed episodes {rate(c['b_well_formed'])} -> {rate(c['a_well_formed'])} (well "
            f"formed only {a} {c['format_a_only']}, only {b} {c['format_b_only']}; McNemar exact p = "
            f"{c['format_mcnemar_p']:.3g}); task: success among well-formed {rate(c['b_task_success'])} -> "
            f"{rate(c['a_task_success'])}")


def rl_kept(c: Comparison) -> Check:
    """RL lost no held-out success to the warm start: not more tasks solved only before RL than only after
    with McNemar exact p < 0.05, nor the paired bootstrap 95% interval of the reward difference below 0. The
    check a single run can hold on any machine (`.ci/run` requires it): a gain at one seed is not a learning
    claim (the main job's RL gained at 2 of 5 seeds, and at seed 0 on one CPU and not on another;
    benchmarks/README.md), a significant loss is a regression. N/A as RL_IMPROVED is."""
    if c.why:
        return Check(RL_KEPT, False, NA, c.why)
    lost = c.worsened > c.improved and c.mcnemar_p < RL_IMPROVED_P
    return _judged(RL_KEPT, False, not lost and c.reward_diff_ci95[1] >= 0, _rl_vs_warm_start(c))


def rl_improved(c: Comparison) -> Check:
    """The eval after RL beats the eval at the warm start's end on the tasks both finished: more tasks solved
    only after RL than only before with McNemar exact p < 0.05, or the paired bootstrap 95% interval of the
    reward difference above 0. N/A without a warm start, an RL step, or per-task results in both evals."""
    if c.why:
        return Check(RL_IMPROVED, False, NA, c.why)
    by_success = c.improved > c.worsened and c.mcnemar_p < RL_IMPROVED_P
    return _judged(RL_IMPROVED, False, by_success or c.reward_diff_ci95[0] > 0, _rl_vs_warm_start(c))


# the rollout's counts that say why RL steps had no episode or no valid action (`describe_rl_signal`)
RL_EPISODE_COUNTERS = (ENV_REJECTED_ACTIONS, EPISODES_ENDED_AT_RESET, EPISODES_DROPPED)

NO_SIGNAL_FIX = ("warm-start from demonstrations ([training] warmup_sft_steps with the env's oracle_policy, "
                 "or recorded episodes in [data] traces), or use a model that already writes valid actions "
                 "([model] name)")


def _groups_with_spread(t: Mapping[str, Any]) -> str:
    if GROUPS not in t:
        return ""
    return f", {t[GROUPS] - t.get(GROUPS_ZERO_ADVANTAGE, 0)} of {t[GROUPS]} groups had rewards that differ"


ENV_REJECTS_FIX = ("the env raised on the actions themselves (the env_action_rejected lines give its words): "
                   "where it answers every action with one message, its setup lacks something (a key, a "
                   "service) that no model can give it; fix the env's setup")


def updated_weights(m: Mapping[str, Any]) -> bool:
    """Whether a train step's update reached the weights (`optimizer_steps` > 0): a step whose gradient was
    non-finite (an inf loss) is skipped and trains nothing, whatever tokens it read. A step logged before
    the metric existed counts as updated."""
    n = m.get(OPTIMIZER_STEPS)
    return n is None or (isinstance(n, int | float) and not isinstance(n, bool) and n > 0)


NO_UPDATE_FIX = ("a finite loss: the advantage settings ([rollout] all_fail_advantage, "
                 "positive_advantage_weight) and [backend] lr; the steps' nonfinite_grad_skips count the "
                 "skips")


def describe_rl_signal(t: Mapping[str, Any]) -> str:
    """One line on RL totals: steps, rl_steps_with_signal, action_tokens, actions, valid_actions[,
    rl_steps_without_update, echo_tokens, groups, groups_zero_advantage, env_rejected_actions,
    episodes_ended_at_reset, episodes_dropped]. Without action tokens it says what did train (ECHO, or
    nothing) and why: no update (every step's gradient non-finite), no episode (each reset ended it, or each
    was dropped), the env rejecting the actions, or invalid actions."""
    rejected, skipped = t.get(ENV_REJECTED_ACTIONS, 0), t.get(RL_STEPS_WITHOUT_UPDATE, 0)
    head = (f"{t[RL_STEPS_WITH_SIGNAL]} of {t[RL_STEPS]} RL steps trained action tokens "
            f"({t[ACTION_TOKENS]} with an advantage); {t[RL_VALID_ACTIONS]} of {t[RL_ACTIONS]} actions were "
            f"valid{f' ({rejected} rejected by the env)' if rejected else ''}{_groups_with_spread(t)}"
            f"{f'; {skipped} took no optimizer step (a non-finite gradient)' if skipped else ''}")
    if t[ACTION_TOKENS]:
        return head
    if skipped and skipped == t[RL_STEPS]:
        return f"{head}, so nothing trained: RL learned nothing. Fix: {NO_UPDATE_FIX}"
    if not t[RL_ACTIONS]:
        ended, dropped = t.get(EPISODES_ENDED_AT_RESET, 0), t.get(EPISODES_DROPPED, 0)
        why = [f"{ended} ended at their reset (the env_reset_ended line gives the env's reason; fix what the "
               "env needs)" if ended else "",  # coding_tools_env without its sandbox key
               f"{dropped} were dropped (the env_episode_dropped events say why; fix what drops them)"
               if dropped or not ended else ""]  # dipg_safety_env: its step broke the contract
        return (f"{head}; no episode was played to train: of the episodes, "
                f"{' and '.join(w for w in why if w)}; so RL learned nothing")
    fix = ENV_REJECTS_FIX if 2 * rejected >= t[RL_ACTIONS] - t[RL_VALID_ACTIONS] > 0 else NO_SIGNAL_FIX
    if t.get(ECHO_TOKENS, 0) > 0:
        return f"{head}; every advantage was 0, so only ECHO trained: RL learned nothing. Fix: {fix}"
    return (f"{head}; every advantage was 0 and no ECHO token trained, so nothing trained: RL learned "
            f"nothing. Fix: {fix}")


def training_apart(s: RunSummary) -> list[Check]:
    """RL and ECHO judged apart ("trained at least one step" passes on either): reported, not required, since
    a run may rightly be ECHO-only; quaero/telemetry/outcomes.py says the same during the run."""
    if not s.rl_steps:
        rl = Check(RL_TRAINED, False, NA, "no RL step")
    else:  # the totals describe_rl_signal reads, as quaero/telemetry/outcomes.py keeps them during a run
        t = {RL_STEPS: s.rl_steps, RL_STEPS_WITH_SIGNAL: s.rl_steps_with_signal,
             RL_STEPS_WITHOUT_UPDATE: s.rl_steps_without_update,
             ECHO_TOKENS: s.rl_echo_tokens, ACTION_TOKENS: s.rl_action_tokens, RL_ACTIONS: s.rl_actions,
             RL_VALID_ACTIONS: s.rl_valid_actions, ENV_REJECTED_ACTIONS: s.rl_env_rejected_actions,
             EPISODES_ENDED_AT_RESET: s.rl_episodes_ended_at_reset, EPISODES_DROPPED: s.rl_episodes_dropped,
             **({GROUPS: s.rl_groups, GROUPS_ZERO_ADVANTAGE: s.rl_groups_zero_advantage}
                if s.rl_groups is not None else {})}
        rl = _judged(RL_TRAINED, False, s.rl_action_tokens > 0, describe_rl_signal(t))
    echo = _judged(ECHO_TRAINED, False, s.echo_tokens > 0, f"echo tokens={s.echo_tokens} > 0 "
                   f"({s.rl_echo_tokens} in RL steps)")
    return [rl, echo]


def unmet(checks: list[Check], *, require_proof: bool, names: Iterable[str] = ()) -> list[str]:
    """One line per requirement the checks miss. `require_proof`: every required check that applies
    passes (n/a is fine: the check does not apply). `names`: each named check passes (n/a is not)."""
    by_name = {c.name: c for c in checks}
    wanted = [c for c in checks if require_proof and c.required and c.status == FAIL]
    wanted += [by_name[n] for n in dict.fromkeys(names) if by_name[n].status != PASS
               and by_name[n] not in wanted]
    return [f"{c.name}: {c.status.upper()} ({c.detail})" for c in wanted]
