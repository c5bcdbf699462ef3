"""The step's loss terms. Each names its targets (per row and token, a weight: 0 where the token is not one),
reads the microbatch's one shifted log-prob tensor `lp` [B, L-1], returns its loss (already scaled by its
step-wide denominator: trainers/aggregation.py) with statistics of its own, and turns the step's totals of
those statistics into its own metrics.

trainers/step.py asks every term of `TERMS` for its targets (`row_targets`: the microbatches' weights, the
selective path's targets and the crop's first target are derived from them, trainers/batch.py), runs every
term on every microbatch that trains, adds their losses into the one backward, totals each term's statistics
over microbatches and ranks, and merges the terms' metrics: it names no term. A new term, with targets of a
kind no other term has, is a subclass of `LossTerm` here added to `TERMS` (its targets, its row scales, its
loss, its statistics, its metrics), the setting it reads (an `option` field of trainers/spec.py, which gives
the config its key), and its metric names declared in quaero/telemetry/names.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from quaero.rows import EchoRow
from quaero.telemetry import names
from trainers import aggregation
from trainers.batch import Microbatch
from trainers.loss import LogprobGap, PolicyStats, logprob_gap, nll_loss
from trainers.policy_losses import policy_loss
from trainers.reference import KLStats, kl_penalty, kl_targets
from trainers.spec import TrainerSpec


@dataclass(frozen=True)
class StepContext:
    """What every term of one step reads beside the spec: an SFT step (demonstrations, scored at T 1) or an RL
    one, this step's ECHO weight λ (a schedule's value), and whether the KL penalty trains."""

    sft: bool
    echo_weight: float
    kl: bool = False  # the reference's log-probs are in the microbatches: the KL term trains


class Stats(Protocol):
    """A term's statistics: sums over its tokens that add up over microbatches and ranks."""

    def add(self, other: Any) -> None: ...


@dataclass
class TermTotal:
    """One term over a step: its denominator (targets over all ranks), its loss summed over microbatches and
    ranks, and its statistics added likewise."""

    tokens: int
    stats: Stats
    loss: float = 0.0

    def add(self, loss: float, stats: Stats) -> None:
        self.loss += loss
        self.stats.add(stats)


class NoStats:
    def add(self, other: NoStats) -> None:
        pass


class LossTerm:
    """One loss term of the step. Subclass it: `row_weights`, `row_scales`, `loss`, `metrics` are its own."""

    name: str  # the key of its total, its weights and its scales in the step (not a metric name)

    def row_weights(self, spec: TrainerSpec, row: EchoRow, ctx: StepContext) -> list[float]:
        """Per token of `row` (EchoRow convention): its weight as this term's target, 0 where it is none; the
        targets (weight != 0) over the step's ranks are its `tokens`. Token 0 never is one (the batcher
        zeroes it)."""
        raise NotImplementedError

    def row_reads(self, spec: TrainerSpec, row: EchoRow, ctx: StepContext) -> list[bool] | None:
        """Per token of `row`: whether the term reads its log-prob without training it (None: its targets
        only)."""
        return None

    def row_scales(self, spec: TrainerSpec, rows: list[EchoRow], counts: list[int], ctx: StepContext
                   ) -> list[float]:
        """Per row of the whole step (every rank's), given its targets per row (`counts`): the factor of each
        of its targets, its denominator included (`Microbatch.scales[name]`)."""
        raise NotImplementedError

    def new_stats(self) -> Stats:
        """Empty statistics."""
        return NoStats()

    def loss(self, spec: TrainerSpec, mb: Microbatch, lp: Tensor, ctx: StepContext) -> tuple[Tensor, Stats]:
        """Its scaled loss over the microbatch (a scalar with grad) and the microbatch's statistics."""
        raise NotImplementedError

    def metrics(self, spec: TrainerSpec, total: TermTotal, ctx: StepContext) -> dict[str, Any]:
        """Its metrics from the step's total (every name declared in quaero/telemetry/names.py)."""
        raise NotImplementedError


@dataclass
class Targets:
    """The step's targets, from every term of TERMS: per term's name, per row, each token's target weight;
    per row, the tokens read beside them; per term, per row, its targets (token 0 never counts)."""

    weights: dict[str, list[list[float]]]
    reads: list[list[bool]]
    counts: dict[str, list[int]]


def row_targets(terms: tuple[LossTerm, ...], spec: TrainerSpec, rows: list[EchoRow], ctx: StepContext
                ) -> Targets:
    """What each term of `terms` trains and reads in `rows`: the one source of the microbatches' masks."""
    weights = {term.name: [term.row_weights(spec, r, ctx) for r in rows] for term in terms}
    reads = [[False] * len(r) for r in rows]
    for term in terms:
        for i, r in enumerate(rows):
            extra = term.row_reads(spec, r, ctx)
            if extra is not None:
                reads[i] = [a or b for a, b in zip(reads[i], extra)]
    counts = {name: [sum(1 for w in ws[1:] if w != 0.0) for ws in per_row]
              for name, per_row in weights.items()}
    return Targets(weights, reads, counts)


@dataclass
class PolicyTermStats:
    policy: PolicyStats = field(default_factory=PolicyStats)
    gap: LogprobGap = field(default_factory=LogprobGap)

    def add(self, other: PolicyTermStats) -> None:
        self.policy.add(other.policy)
        self.gap.add(other.gap)


class PolicyTerm(LossTerm):
    """The RL term (`[loss.policy]`, trainers/policy_losses.py: by default a token-level policy
    gradient with the importance ratio over the sampler's log-probs and PPO clipping; the sampler-vs-trainer
    gap measured on every sampled action token), or on an SFT step the NLL of the demonstrated actions (no
    ratio, no gap: nothing was sampled)."""

    name = "policy"

    def row_weights(self, spec: TrainerSpec, row: EchoRow, ctx: StepContext) -> list[float]:
        """An SFT step: every demonstrated action token; an RL step: the action tokens with an advantage."""
        if ctx.sft:
            return [1.0 if a else 0.0 for a in row.action_mask]
        return [1.0 if a != 0.0 else 0.0 for a in row.advantages]  # advantages sit on action tokens only

    def row_reads(self, spec: TrainerSpec, row: EchoRow, ctx: StepContext) -> list[bool]:
        return row.action_mask  # the sampler gap reads every sampled action token

    def row_scales(self, spec: TrainerSpec, rows: list[EchoRow], counts: list[int], ctx: StepContext
                   ) -> list[float]:
        return aggregation.rl_scales(rows, counts, sft=ctx.sft, aggregation=spec.loss_aggregation,
                                     constant=spec.loss_constant)

    def new_stats(self) -> PolicyTermStats:
        return PolicyTermStats()

    def loss(self, spec: TrainerSpec, mb: Microbatch, lp: Tensor, ctx: StepContext
             ) -> tuple[Tensor, PolicyTermStats]:
        mask = mb.targets(self.name)[:, 1:]
        if ctx.sft:
            return nll_loss(lp, mask, mb.scales[self.name]), PolicyTermStats()
        sampler_lp = mb.sampler_logprobs[:, 1:]
        recorded = None if mb.old_logprobs is None else mb.old_logprobs[:, 1:]
        guided = None if mb.guided is None else mb.guided[:, 1:]
        loss, policy = policy_loss(lp, sampler_lp, mb.advantages[:, 1:], mask, mb.scales[self.name],
                                   spec.policy_loss, spec.behaviour, old_logprobs=recorded, guided=guided)
        sampled = mb.action_mask[:, 1:] if guided is None else mb.action_mask[:, 1:] & ~guided
        return loss, PolicyTermStats(policy, logprob_gap(lp, sampler_lp, sampled))

    def metrics(self, spec: TrainerSpec, total: TermTotal, ctx: StepContext) -> dict[str, Any]:
        pg, gap = total.stats.policy, total.stats.gap
        return {
            names.RL_LOSS: 0.0 if ctx.sft else total.loss, names.SFT_LOSS: total.loss if ctx.sft else 0.0,
            names.ACTION_TOKENS: total.tokens,
            names.LOSS_AGGREGATION: "token_mean" if ctx.sft else spec.loss_aggregation,
            # None where nothing was measured (an SFT step samples nothing; an all-zero-advantage step has no
            # ratio): a 0 or 1 there would read as a perfect agreement that was never seen
            names.SAMPLER_LOGPROB_GAP_MEAN: gap.mean if gap.tokens else None,
            names.SAMPLER_LOGPROB_GAP_MAX: gap.max if gap.tokens else None,
            names.IMPORTANCE_RATIO_MEAN: pg.ratio_sum / pg.tokens if pg.tokens else None,
            names.CLIP_FRACTION: pg.clipped / pg.tokens if pg.tokens else None,
            **policy_loss_metrics(spec, pg, ctx),
            **guidance_metrics(pg, ctx),
        }


def policy_loss_metrics(spec: TrainerSpec, pg: PolicyStats, ctx: StepContext) -> dict[str, Any]:
    """The policy-loss variant's own figures (trainers/policy_losses.py): None where it measured nothing."""
    def share(n: int) -> float | None:
        return n / pg.tokens if pg.tokens else None

    return {
        names.POLICY_LOSS: "sft" if ctx.sft else spec.policy_loss.name,
        names.CLIP_LOW_FRACTION: share(pg.clipped_low), names.CLIP_HIGH_FRACTION: share(pg.clipped_high),
        names.SAMPLER_CORRECTION: spec.sampler_correction,
        names.SAMPLER_IS_WEIGHT_MEAN: pg.is_sum / pg.is_tokens if pg.is_tokens else None,
        names.SAMPLER_IS_WEIGHT_MAX: pg.is_max if pg.is_tokens else None,
        names.SAMPLER_IS_CUT_FRACTION: pg.is_cut / pg.is_tokens if pg.is_tokens else None,
        names.SEQUENCE_RATIO_MEAN: pg.seq_ratio_sum / pg.sequences if pg.sequences else None,
        names.SEQUENCE_RATIO_MIN: pg.seq_ratio_min if pg.sequences else None,
        names.SEQUENCE_RATIO_MAX: pg.seq_ratio_max if pg.sequences else None,
    }


def guidance_metrics(pg: PolicyStats, ctx: StepContext) -> dict[str, Any]:
    """The RL term's guided and sampled targets and the policy shaping weight f(π) on the guided ones
    (trainers/policy_losses.py): None where no guided token trained."""
    g = pg.guided_tokens
    return {names.GUIDED_ACTION_TOKENS: 0 if ctx.sft else g, names.ONPOLICY_ACTION_TOKENS: 0 if ctx.sft
            else pg.tokens,
            names.GUIDANCE_SHAPING_MEAN: pg.shaping_sum / g if g else None,
            names.GUIDANCE_SHAPING_MIN: pg.shaping_min if g else None,
            names.GUIDANCE_SHAPING_MAX: pg.shaping_max if g else None}


class EchoTerm(LossTerm):
    """ECHO: λ times the weighted NLL of the environment's response tokens, read from the same `lp`."""

    name = "echo"

    def row_weights(self, spec: TrainerSpec, row: EchoRow, ctx: StepContext) -> list[float]:
        """The row's ECHO weights (positive on model-visible environment tokens only), none with ECHO off."""
        return list(row.echo_weights) if spec.echo else [0.0] * len(row)

    def row_scales(self, spec: TrainerSpec, rows: list[EchoRow], counts: list[int], ctx: StepContext
                   ) -> list[float]:
        return aggregation.echo_scales(rows, counts, normalization=spec.echo_normalization)

    def loss(self, spec: TrainerSpec, mb: Microbatch, lp: Tensor, ctx: StepContext) -> tuple[Tensor, NoStats]:
        weights = mb.weights[self.name][:, 1:]
        loss = nll_loss(lp, weights != 0, mb.scales[self.name], weights=weights, coef=ctx.echo_weight)
        return loss, NoStats()

    def metrics(self, spec: TrainerSpec, total: TermTotal, ctx: StepContext) -> dict[str, Any]:
        return {names.ECHO_LOSS: total.loss, names.ECHO_TOKENS: total.tokens,
                names.ECHO_WEIGHT: ctx.echo_weight if spec.echo else 0.0,
                names.ECHO_NORMALIZATION: spec.echo_normalization}


class KLTerm(LossTerm):
    """The KL penalty against the frozen reference (`[loss] beta`, `kl_estimator`; trainers/reference.py):
    β times the per-token estimate on every sampled action token of an RL step, with the RL term's
    aggregation over its own targets. No targets without a reference (β = 0, a warm-start step)."""

    name = "kl"

    def row_weights(self, spec: TrainerSpec, row: EchoRow, ctx: StepContext) -> list[float]:
        return kl_targets(row) if ctx.kl and not ctx.sft else [0.0] * len(row)

    def row_scales(self, spec: TrainerSpec, rows: list[EchoRow], counts: list[int], ctx: StepContext
                   ) -> list[float]:
        return aggregation.rl_scales(rows, counts, sft=False, aggregation=spec.loss_aggregation,
                                     constant=spec.loss_constant)

    def new_stats(self) -> KLStats:
        return KLStats()

    def loss(self, spec: TrainerSpec, mb: Microbatch, lp: Tensor, ctx: StepContext) -> tuple[Tensor, KLStats]:
        if mb.ref_logprobs is None:
            return lp.new_zeros(()), KLStats()
        return kl_penalty(lp, mb.ref_logprobs[:, 1:], mb.targets(self.name)[:, 1:], mb.scales[self.name],
                          spec.beta, spec.kl_estimator)

    def metrics(self, spec: TrainerSpec, total: TermTotal, ctx: StepContext) -> dict[str, Any]:
        kl = total.stats
        return {names.KL_LOSS: total.loss, names.KL_TOKENS: total.tokens,
                names.KL_MEAN: kl.total / kl.tokens if kl.tokens else None,
                names.KL_MAX: kl.max if kl.tokens else None}


TERMS: tuple[LossTerm, ...] = (PolicyTerm(), EchoTerm(), KLTerm())
