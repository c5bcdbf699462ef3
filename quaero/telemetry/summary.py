"""A reviewed run, typed: the events `quaero review` reads (`RunRecord`, quaero/tools/review.py `load_run`)
and the summary it builds from them (`RunSummary`, `summarize`), which the proofs (quaero/telemetry/proofs.py)
judge and the table and `--json` print.

Each figure is a field, read by its name; `to_dict` is the `--json` summary, whose keys are the field names
(a few are metric names of quaero/telemetry/names.py, totalled over the run) and stay as users read them: the
step's branch metrics (`selective`) are written at the top level under their own names, and the figures a
run may not have (`rl_groups` without group counts, `per_env` outside a mixture, `resumed_with_changed_config`
without such a resume) are left out when they are empty. No torch here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

from quaero.telemetry import names

# `field` metadata: FLAT writes a dict's items at the top level of `to_dict`; OPTIONAL leaves out None or {};
# HEADING is said in the table's heading, not in a row of it
FLAT, OPTIONAL, HEADING = {"flat": True}, {"optional": True}, {"heading": True}


def _plain(value: Any) -> Any:
    if is_dataclass(value):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


class _Record:
    def to_dict(self) -> dict[str, Any]:
        """The JSON-able dict `quaero review --json` writes."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("flat"):
                out.update(_plain(value))
            elif not (f.metadata.get("optional") and value in (None, {})):
                out[f.name] = _plain(value)
        return out


@dataclass(frozen=True)
class RunRecord:
    """A run's events.jsonl as `quaero review` reads it (quaero/tools/review.py `load_run`): every readable
    event, the train steps (one per (phase, step), the latest record of a re-run step, in step order with
    the warm start first at a shared step) and the evals (one per step, in step order), the lines left out,
    and whether the run logged its end."""

    path: str  # the events file read
    events: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    unreadable: int  # lines not read: not UTF-8, not a JSON object, a train/eval event off the step axis
    ended: bool  # a `run_end` event was logged (finished, failed or interrupted)

    def of_kind(self, *kinds: str) -> list[dict[str, Any]]:
        """The run's events of the given kinds (`event` names of quaero/telemetry/names.py), in file order."""
        return [e for e in self.events if e.get("event") in kinds]


@dataclass(frozen=True)
class Comparison(_Record):
    """The last eval after RL against the eval at the warm start's end, paired on the tasks both finished
    (quaero/tools/significance.py `paired_outcomes`). `why` says what is missing when there is nothing to
    compare; the other fields are then None."""

    why: str
    warm_start_step: int | None = None
    end_step: int | None = None
    pairs: int | None = None
    warm_start_success: float | None = None
    end_success: float | None = None
    improved: int | None = None  # tasks solved only after RL
    worsened: int | None = None  # tasks solved only before
    mcnemar_p: float | None = None
    reward_diff: float | None = None  # end - warm start
    reward_diff_ci95: tuple[float, float] | None = None  # paired bootstrap
    # both evals recorded no guided token (`eval_guided_tokens` 0): the policy's own, unguided; None: not
    # recorded (a run from before the count)
    unguided: bool | None = None
    # the success change split into format and task (quaero/tools/significance.py `format_and_task`: the share
    # of well-formed episodes, paired, and success among the well-formed); None where an eval recorded no
    # formats (a run from before `eval_formats`)
    format_task: dict[str, Any] | None = field(default=None, metadata=OPTIONAL)
    # the tasks behind `improved` and `worsened`: solved only after RL (fixed), only before (regressed)
    fixed: list | None = field(default=None, metadata=OPTIONAL)
    regressed: list | None = field(default=None, metadata=OPTIONAL)

    def to_dict(self) -> dict[str, Any]:
        return {"why": self.why} if self.why else super().to_dict()


@dataclass(frozen=True)
class EnvFigures(_Record):
    """One env of a mixture: its RL groups, those with signal, its generated tokens and lost episodes, its
    last eval's success rate, and its own comparison of RL against the warm start."""

    groups: int | float
    signal_groups: int | float
    generated_tokens: int | float
    signal_groups_per_1k_tokens: float | None
    episodes_lost: int | float
    eval_success_last: float | None
    rl_vs_warm_start: Comparison


@dataclass(frozen=True)
class ConfigChange(_Record):
    """A resume under another config than the run's last: the keys that changed, {key: [old, new]}, and
    those of them that reach what a step trains."""

    changes: dict[str, list]
    trained: list[str]


@dataclass(frozen=True)
class Guidance(_Record):
    """How much of RL's signal came from guides (`[guidance] mode`), totals over the RL steps: groups
    guided and groups with signal that were, guided members (their successes, those dropped), and the
    trained action tokens a guide chose against the policy's own."""

    groups: int | float
    groups_guided: int | float
    signal_groups: int | float
    signal_groups_guided: int | float
    guided_members: int | float
    guided_members_succeeded: int | float
    guided_members_dropped: int | float
    guided_action_tokens: int | float
    onpolicy_action_tokens: int | float


@dataclass(frozen=True)
class RunSummary(_Record):
    """A reviewed run. Counts are totals over its steps; `rl_*` over its RL steps apart from the warm start;
    `*_first` / `*_last` the mean of the first / last few values of a series."""

    steps: int
    sft_steps: int
    rl_steps: int
    last_step: int | None
    finished: bool = field(metadata=HEADING)  # a run_end event was logged
    unreadable_lines: int
    train_reward_first: float | None  # RL steps only: the warm start's reward is the oracle's
    train_reward_last: float | None
    train_success_last: float | None
    eval_reward_baseline: float | None  # the untrained eval's (step 0, before any step); None if none logged
    eval_reward_last: float | None
    eval_success_last: float | None
    rl_loss_first: float | None
    rl_loss_last: float | None
    echo_loss_first: float | None  # steps with ECHO targets only
    echo_loss_last: float | None
    rows: int | float
    action_tokens: int | float
    echo_tokens: int | float
    # RL apart from the warm start: quaero/telemetry/outcomes.py's totals, judged by the "RL trained" proof
    rl_steps_with_signal: int
    rl_steps_without_update: int  # RL steps the optimizer skipped (a non-finite gradient): none trained
    rl_action_tokens: int | float
    rl_echo_tokens: int | float
    rl_actions: int | float
    rl_valid_actions: int | float
    rl_env_rejected_actions: int | float
    rl_episodes_ended_at_reset: int | float
    rl_episodes_dropped: int | float
    rl_groups: int | float | None = field(metadata=OPTIONAL)  # None: the steps logged no group counts
    rl_groups_zero_advantage: int | float | None = field(metadata=OPTIONAL)
    row_tokens: int | float
    step_time_median_s: float | None
    # the trainer step's peak, each phase's own where the device resets it (trainers/memory.py), the process's
    peak_mem_mb: float | None
    rollout_peak_mem_mb: float | None
    weight_sync_peak_mem_mb: float | None
    process_peak_mem_mb: float | None
    eval_peak_mem_mb: float | None
    checkpoint_peak_mem_mb: float | None  # of the checkpoints written and read
    env_retries: int | float
    episodes_dropped: int | float
    episodes_ended_at_reset: int | float
    env_rejected_actions: int | float
    malformed_actions: int | float
    bridge_fallbacks: int | float
    prefix_mismatches: int | float
    rows_packed: int | float
    rows_transition: int | float
    sampler_logprob_gap_max: float | None
    # what the log-prob gap proof judges: steps whose rows the trained weights sampled
    onpolicy_gap_steps: int
    onpolicy_logprob_gap_max: float | None
    onpolicy_logprob_gap_mean_max: float | None
    weight_transfer: str | None  # how the pushes reached the sampler: "file", "nccl", "ipc", "copy", joined
    # rows sampled ahead ([rollout] max_off_policy_steps): how old they got, how much clipping held
    policy_staleness_max: float | None
    clip_fraction_max: float | None
    # the policy-loss family's figures over RL steps (`policy_loss_figures`), each where some step measured it
    policy_loss: dict[str, float] = field(metadata=FLAT)
    # the step's branch metrics by their names (quaero/telemetry/proofs.py STEP_PROOF_METRICS): the
    # selective mode, compile mode and latest fallback reason, and each branch counter's total
    selective: dict[str, Any] = field(metadata=FLAT)
    rl_vs_warm_start: Comparison
    # the learning signal per generated token (the task samplers' aim)
    rl_signal_groups: int | float
    rl_generated_tokens: int | float
    rl_signal_groups_per_1k_tokens: float | None
    per_env: dict[str, EnvFigures] = field(metadata=OPTIONAL)  # a mixture's figures per env
    # resumes under another config than the run's last, by checkpoint step
    resumed_with_changed_config: dict[str, ConfigChange] = field(metadata=OPTIONAL)
    guidance: Guidance | None = field(default=None, metadata=OPTIONAL)  # None: no RL step guided
    # the last eval's held-out figures (quaero/tools/review.py `held_out`): success's standard error, format
    # failures and wrong answers, pass@k where it was sampled; each only where the eval carries it
    eval_last: dict[str, Any] = field(default_factory=dict, metadata=FLAT)
    # per phase (sft, rl): the process's RSS after its warm-up against its largest later reading
    # (quaero/tools/memory_growth.py `rss_growth`); {} where no step logged `process_rss_mb`
    rss_growth: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=OPTIONAL)
    # the first eval's step where the run logged evals but none of the untrained model (step 0): a run started
    # from a checkpoint copied into a fresh folder; None otherwise
    evals_start_at: int | None = field(default=None, metadata=OPTIONAL)

    def table_rows(self) -> list[tuple[str, Any]]:
        """The table's (metric, value) rows: every figure but the heading's and the nested ones (the checks'
        lines, the per-env and resume lines say those)."""
        heading = {f.name for f in fields(self) if f.metadata.get("heading")}
        return [(k, v) for k, v in self.to_dict().items() if k not in heading and not isinstance(v, dict)]


# `quaero review`'s policy-loss figures (trainers/policy_losses.py, trainers/reference.py): per step metric,
# how its RL steps' values total (the mean, the extreme, the last)
LOSS_FIGURES = ((names.CLIP_LOW_FRACTION, "mean"), (names.CLIP_HIGH_FRACTION, "mean"),
                (names.SAMPLER_IS_WEIGHT_MEAN, "mean"), (names.SAMPLER_IS_WEIGHT_MAX, "max"),
                (names.SAMPLER_IS_CUT_FRACTION, "mean"), (names.KL_MEAN, "mean"), (names.KL_MEAN, "last"),
                (names.KL_MAX, "max"), (names.SEQUENCE_RATIO_MEAN, "mean"), (names.SEQUENCE_RATIO_MIN, "min"),
                (names.SEQUENCE_RATIO_MAX, "max"), (names.REFERENCE_FORWARD_S, "mean"))
_TOTALS = {"mean": lambda vs: sum(vs) / len(vs), "max": max, "min": min, "last": lambda vs: vs[-1]}


def policy_loss_figures(rl_steps: list[dict]) -> dict[str, float]:
    """Each of LOSS_FIGURES over the RL steps that measured it (a step logs None where it measured nothing),
    named `<metric>` where the metric's name says the total already, else `<metric>_<total>`; a figure no step
    measured is left out (a run without a sampler correction has no importance-weight figures)."""
    out = {}
    for name, how in LOSS_FIGURES:
        values = [v for st in rl_steps if type(v := st.get(name)) in (int, float)]
        if values:
            out[name if name.endswith(f"_{how}") else f"{name}_{how}"] = _TOTALS[how](values)
    return out
