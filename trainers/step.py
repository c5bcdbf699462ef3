"""The strict shared-forward step, shared by the `local` and `unsloth` trainers.

Per microbatch: ONE backbone forward -> one shifted log-prob tensor `lp` [B, L-1] (selective path) ->
the RL (or SFT) term and the ECHO term both read `lp` -> ONE backward. Gradients accumulate over the
microbatches; then grad-norm clipping (`max_grad_norm`, always applied when set) and ONE
optimizer step. Each term is normalised by its own step-wide token count (trainers/loss.py), so the
microbatch split never changes the result. A microbatch no loss reads does no forward at all.

Temperature: in an RL step `lp` is log_softmax(logits / T) with T = the sampler's temperature, so the
importance ratio compares the trainer with the distribution the sampler drew from; the step's ECHO term
reads the same tensor (one LM-head pass), so at T != 1 it trains the tempered distribution too. An SFT
step (the warm start, recorded traces) sampled nothing: it scores at T = 1, the model's own distribution,
so the RL temperature never changes what the warm start learns (scored at T 0.7 its gradient was 1/0.7 times
larger: benchmarks/HISTORY.md, "RL over the warm start, third pass").

The sampler-vs-trainer gap is measured on every sampled action token of a microbatch that trains,
whatever its advantage (the selective path computes those log-probs too; no loss reads them).

Under `torchrun` (trainers/distributed.py) each rank trains its token-balanced share of the rows with
the step-wide denominators summed over ranks and gradients summed over ranks: the step is the
one-process step on all rows. Its metrics are every rank's figures summed (maxima where a maximum is
meant), identical on every rank, with the per-rank forward counts beside them.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from quaero import process_group
from quaero.resolve import resolve_name
from quaero.rows import EchoRow
from quaero.telemetry import names
from quaero.telemetry.proofs import BRANCH_COUNTERS
from trainers import distributed
from trainers.batch import CropStats, Microbatch, TrieCost, build_microbatches
from trainers.forward import CausalLMParts, SharedForwardError
from trainers.memory import OffloadStats, peak_mem_mb, reset_peak, saved_tensors_offload
from trainers.selective import SelectiveInfo, full_logprobs, selected_logprobs
from trainers.spec import TrainerSpec
from trainers.terms import TERMS, Stats, StepContext, TermTotal, row_targets
from trainers.tree import TreeInfo, TreePack, choose_tree, planner_cost


class TrainerView(Protocol):
    """What the step reads of a trainer (trainers/base.py `Trainer` is one; this module never imports it): the
    spec, the model and its parts, the device, the step's forward (DDP- or FSDP2-wrapped under torchrun), the
    trainable parameters, the KL penalty's reference, the optimizer and its scheduler."""

    name: str
    spec: TrainerSpec
    model: nn.Module
    parts: CausalLMParts
    device: torch.device
    microbatch_forward: nn.Module
    trainable: list[nn.Parameter]
    reference: Any  # trainers/reference.py `Reference`, once taken; None: no KL penalty
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


class MicrobatchForward(nn.Module):
    """A microbatch's one forward and its target log-probs, as one module call.

    The backbone and the LM head run inside one `forward`, so a DDP or FSDP2 wrapper of this module
    sees the whole computation: its hooks run around it, and FSDP2 unshards the head it owns here.
    """

    def __init__(self, parts: CausalLMParts, spec: TrainerSpec) -> None:
        super().__init__()
        self.lm = parts.model  # registered, so a wrapper of this module holds every parameter
        self.parts, self.spec = parts, spec
        self.selected_logprobs = logprob_function(spec.logprob_fn)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, target_mask: Tensor, temperature: float,
                tree: TreePack | None = None) -> tuple[Tensor, SelectiveInfo]:
        """[B, L-1] fp32 log-probs, selective when enabled and possible; `tree`: the rows' trie to forward
        once instead of the rows (trainers/tree.py), the head then reads the rows' view of it."""
        spec, parts = self.spec, self.parts
        if not spec.selective_logits or not parts.selective_ok:
            # the model's own full logits: "dense" by choice, "fallback" when selective was asked for
            logits = parts.logits(input_ids, attention_mask, tree)
            branch = "fallback" if spec.selective_logits else "dense"
            return full_logprobs(logits, input_ids, target_mask,
                                 temperature=temperature), SelectiveInfo(branch)
        hidden = parts.hidden_states(input_ids, attention_mask, tree)
        return self.selected_logprobs(hidden, parts.lm_head, input_ids, target_mask,
                                      temperature=temperature, policy=spec.selective,
                                      logit_transform=parts.transform)


def logprob_function(name: str) -> Callable[..., tuple[Tensor, SelectiveInfo]]:
    """`TrainerSpec.logprob_fn`: "" is `selected_logprobs`; "package.module:function" names another function
    of its signature (the benchmarks' peer LM-head methods), resolved here once per trainer."""
    if not name:
        return selected_logprobs
    return resolve_name(name, "TrainerSpec.logprob_fn", want=callable,
                        wanted="a function with the signature of trainers.selective.selected_logprobs",
                        example="benchmarks.peers:chunked_all_positions_logprobs")


def microbatch_logprobs(trainer: TrainerView, mb: Microbatch, temperature: float
                        ) -> tuple[Tensor, SelectiveInfo]:  # [B, L-1] fp32
    """The microbatch's one forward and its target log-probs at `temperature` (selective when enabled and
    possible), over the rows' trie where `train_tree_packing` packs it (`info.extra["tree"]`: the
    decision, a trainers/tree.py `TreeInfo`)."""
    tree, tree_info = choose_tree(trainer.spec.tree_packing, trainer.parts, mb.input_ids, mb.attention_mask,
                                  blocker=tree_blocker(trainer))
    lp, info = trainer.microbatch_forward(mb.input_ids, mb.attention_mask, mb.target_mask, temperature, tree)
    info.extra["tree"] = tree_info
    return lp, info


def tree_blocker(trainer: TrainerView) -> str:
    """Why this trainer cannot pack rows as a trie whatever the model ("" when it can)."""
    if trainer.name == "unsloth":
        return "unsloth's attention kernels build their own causal mask"
    if trainer.spec.distributed == "fsdp2":
        return "fsdp2: the packing probe reads unsharded weights"
    return ""


def trie_planner(trainer: TrainerView, rows: list[EchoRow]) -> TrieCost | None:
    """How this step's microbatches are costed where tree packing will forward them as tries (trainers/tree.py
    `planner_cost`: on the trie's unique tokens), or None (on their padded rows)."""
    if trainer.spec.tree_plan == "padded":
        return None
    longest = max((len(r) for r in rows), default=0)
    return planner_cost(trainer.spec.tree_packing, trainer.parts, longest, blocker=tree_blocker(trainer))


def step_temperature(spec: TrainerSpec, *, sft: bool) -> float:
    """The temperature a step scores at: the sampler's for RL (the importance ratio's), 1 for SFT."""
    return 1.0 if sft else spec.temperature


def padding_backward(trainer: TrainerView) -> None:
    """A zero-loss forward and backward through every parameter, for a rank with fewer microbatches.

    One selected token makes the LM head run too, so each parameter gets a (zero) gradient and the
    rank takes part in every collective its busier peers run; nothing is counted as training.
    """
    ids = torch.zeros(1, 2, dtype=torch.long, device=trainer.device)
    target = torch.tensor([[False, True]], device=trainer.device)
    lp, _ = trainer.microbatch_forward(ids, torch.ones_like(ids), target, 1.0)
    (lp.sum() * 0.0).backward()


def _count_branch(counts: dict, info: SelectiveInfo) -> None:
    for name, counted in BRANCH_COUNTERS.items():
        counts[name] += int(counted(info))


@dataclass
class StepTotals:
    """What one step accumulates over its microbatches: the shape of its work, and per loss term
    (trainers/terms.py, by name) its denominator, loss and statistics."""

    terms: dict[str, TermTotal]
    rows: int = 0
    microbatches: int = 0
    row_tokens: int = 0
    padded_tokens: int = 0
    crop: CropStats = field(default_factory=CropStats)
    # zero-loss forwards that keep this rank in step with the others (trainers/distributed.py)
    padding: int = 0
    forward_passes: int = 0
    skipped: int = 0  # microbatches no loss reads: no forward, no LM head, no backward
    fallback_reason: str = ""
    branches: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BRANCH_COUNTERS, 0))
    offload: OffloadStats = field(default_factory=OffloadStats)
    tree_batches: int = 0  # microbatches forwarded as a trie
    tree_unique_tokens: int = 0  # over the microbatches a trie was built for
    tree_row_tokens: int = 0
    tree_fallback: int = 0
    tree_fallback_reason: str = ""

    @classmethod
    def empty(cls, tokens: dict[str, int], **fields: Any) -> StepTotals:
        """Totals with every term of `TERMS` at zero; `tokens`: each term's step-wide denominator."""
        return cls({t.name: TermTotal(tokens[t.name], t.new_stats()) for t in TERMS}, **fields)

    def add(self, losses: dict[str, tuple[Tensor, Stats]], info: SelectiveInfo, compile_mode: str) -> None:
        for name, (loss, stats) in losses.items():
            self.terms[name].add(float(loss.detach()), stats)
        self.forward_passes += 1
        _count_branch(self.branches, info)
        tree: TreeInfo = info.extra.get("tree", TreeInfo())
        self.tree_batches += int(tree.packed)
        self.tree_unique_tokens += tree.unique_tokens
        self.tree_row_tokens += tree.row_tokens if tree.unique_tokens else 0
        self.tree_fallback += int(bool(tree.fallback_reason))
        self.tree_fallback_reason = tree.fallback_reason or self.tree_fallback_reason
        if compile_mode != "off" and info.branch != "none":
            self.fallback_reason = info.fallback_reason  # last writer this step; "" once compiled CE ran

    @classmethod
    def of_ranks(cls, ranks: list[StepTotals]) -> StepTotals:
        """The step's totals from every rank's, in rank order: counts and losses add up, maxima stay
        maxima."""
        out = cls.empty({name: t.tokens for name, t in ranks[0].terms.items()})  # the denominators are global
        for t in ranks:
            for name in ("rows", "microbatches", "row_tokens", "padded_tokens", "padding", "forward_passes",
                         "skipped", "tree_batches", "tree_unique_tokens", "tree_row_tokens", "tree_fallback"):
                setattr(out, name, getattr(out, name) + getattr(t, name))
            for name, term in t.terms.items():
                out.terms[name].add(term.loss, term.stats)
            out.crop = CropStats(out.crop.rows_cropped + t.crop.rows_cropped,
                                 out.crop.tokens_removed + t.crop.tokens_removed)
            # any rank's reason is worth reading
            out.fallback_reason = out.fallback_reason or t.fallback_reason
            out.tree_fallback_reason = out.tree_fallback_reason or t.tree_fallback_reason
            for name, n in t.branches.items():
                out.branches[name] += n
            out.offload.tensors += t.offload.tensors
            out.offload.bytes += t.offload.bytes
        return out


def microbatch_losses(spec: TrainerSpec, mb: Microbatch, lp: Tensor, ctx: StepContext
                      ) -> dict[str, tuple[Tensor, Stats]]:
    """Every loss term of one microbatch, each read from its log-prob tensor `lp` [B, L-1]."""
    return {term.name: term.loss(spec, mb, lp, ctx) for term in TERMS}


def accumulate_gradients(trainer: TrainerView, mbs: list[Microbatch], totals: StepTotals,
                         ctx: StepContext) -> None:
    """Per microbatch: one forward, every loss term, one backward; gradients add up across microbatches.

    With several ranks every rank runs as many backwards as the busiest one (zero-loss padding on the
    others) and gradients are reduced across ranks in the last one only.
    """
    spec, counter = trainer.spec, trainer.parts.counter
    temperature = step_temperature(spec, sft=ctx.sft)
    trained = [mb for mb in mbs if mb.trains]
    totals.skipped += len(mbs) - len(trained)
    passes = process_group.all_max(len(trained))
    totals.padding = passes - len(trained)
    counter.take()
    for k in range(passes):
        with distributed.set_gradient_sync(trainer.microbatch_forward, k == passes - 1):
            if k >= len(trained):
                padding_backward(trainer)
                counter.take()
                continue
            mb = trained[k]
            with saved_tensors_offload(trainer.device, enabled=spec.memory.save_on_cpu,
                                       pin_memory=spec.memory.save_on_cpu_pin_memory,
                                       min_numel=spec.memory.save_on_cpu_min_numel, stats=totals.offload):
                lp, info = microbatch_logprobs(trainer, mb, temperature)
                losses = microbatch_losses(spec, mb, lp, ctx)
            forwards = counter.take()
            if forwards != 1:
                raise SharedForwardError(f"trainer {trainer.name!r}: the loss terms of a microbatch came "
                                         f"from {forwards} forward passes; strict shared forward needs "
                                         "exactly 1")
            first, *rest = (loss for loss, _ in losses.values())
            sum(rest, first).backward()
            totals.add(losses, info, spec.selective.compile_mode)


def optimizer_step(trainer: TrainerView) -> tuple[float, bool]:
    """Clip the accumulated gradient and step, unless its norm is not finite: (grad norm, stepped)."""
    max_norm = trainer.spec.max_grad_norm
    norm = torch.nn.utils.clip_grad_norm_(trainer.trainable, max_norm if max_norm else math.inf)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: the global norm
    stepped = math.isfinite(grad_norm)
    if stepped:  # a non-finite gradient never reaches the weights
        trainer.optimizer.step()
        trainer.scheduler.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def shared_forward_step(trainer: TrainerView, rows: list[EchoRow], *, sft: bool,
                        echo_weight: float | None = None, old_logprobs: list[list[float]] | None = None,
                        ref_logprobs: list[list[float]] | None = None, reference_seconds: float | None = None
                        ) -> dict[str, Any]:
    """One optimizer step over `rows` (RL + ECHO, or SFT + ECHO); returns the step's metrics.
    `echo_weight`: this step's λ (a schedule's value), else the spec's. `old_logprobs`: per row, the
    trainer's log-probs recorded before its rollout batch's first step (trainers/mini_steps.py), which a
    sampler correction's ratio compares with (none: the step's own, detached). `ref_logprobs`: per row, the
    frozen reference's at the KL term's targets (trainers/reference.py; none: no KL penalty), and the seconds
    their forwards took (`reference_seconds`, logged with this step).

    With several ranks, every rank passes the same `rows` and trains its share of them; the loss scales
    come from all of them (trainers/aggregation.py), so every rank's denominators agree.
    """
    spec, model = trainer.spec, trainer.model
    ctx = StepContext(sft=sft, echo_weight=spec.echo_weight if echo_weight is None else echo_weight,
                      kl=ref_logprobs is not None and not sft)
    targets = row_targets(TERMS, spec, rows, ctx)
    scales = {term.name: term.row_scales(spec, rows, targets.counts[term.name], ctx) for term in TERMS}
    t0 = time.perf_counter()
    reset_peak(trainer.device)
    was_training = model.training
    model.train()
    ranks = process_group.world_size()
    share = (distributed.split_rows([len(r) for r in rows], ranks) if spec.tree_packing == "off" or ranks == 1
             else distributed.split_trees([r.input_ids for r in rows], ranks))[process_group.rank()]
    mbs, crop = build_microbatches([rows[i] for i in share], micro_batch_tokens=spec.micro_batch_tokens,
                                   weights={name: [per_row[i] for i in share]
                                            for name, per_row in targets.weights.items()},
                                   reads=[targets.reads[i] for i in share],
                                   context_tokens=spec.memory.supervised_context_tokens,
                                   device=trainer.device,
                                   scales={name: [per_row[i] for i in share] for name,
                                           per_row in scales.items()},
                                   old_logprobs=None if old_logprobs is None else [old_logprobs[i]
                                                                                   for i in share],
                                   ref_logprobs=None if ref_logprobs is None else [ref_logprobs[i]
                                                                                   for i in share],
                                   by_prefix=spec.tree_packing != "off",
                                   trie_cost=trie_planner(trainer, [rows[i] for i in share]))
    tokens = process_group.all_sum([sum(int(mb.targets(term.name).sum()) for mb in mbs) for term in TERMS])
    totals = StepTotals.empty({term.name: n for term, n in zip(TERMS, tokens)}, rows=len(share),
                              microbatches=len(mbs), row_tokens=sum(mb.tokens for mb in mbs),
                              padded_tokens=sum(mb.input_ids.numel() for mb in mbs), crop=crop)
    trainer.optimizer.zero_grad(set_to_none=True)
    accumulate_gradients(trainer, mbs, totals, ctx)
    grad_norm, stepped = optimizer_step(trainer)
    model.train(was_training)
    peak = peak_mem_mb(trainer.device)
    ranks = process_group.gather((totals, peak, time.perf_counter() - t0))
    return step_metrics(trainer, [t for t, _, _ in ranks], ctx=ctx, grad_norm=grad_norm, stepped=stepped,
                        peaks=[p for _, p, _ in ranks], seconds=max(s for _, _, s in ranks),
                        reference_seconds=reference_seconds)


def step_metrics(trainer: TrainerView, ranks: list[StepTotals], *, ctx: StepContext, grad_norm: float,
                 stepped: bool, peaks: list[tuple[float, str]], seconds: float,
                 reference_seconds: float | None = None) -> dict[str, Any]:
    """The step's event fields from every rank's totals, each loss term's own metrics among them (every name
    declared in quaero/telemetry/names.py). Per-rank figures (`rank_*`) appear when there is more than one
    rank."""
    spec = trainer.spec
    t = StepTotals.of_ranks(ranks)
    peak, source = max(peaks)
    peak = round(peak, 1)  # as every other peak field: the process's (rounded alike) is never below it
    trained = t.microbatches - t.skipped
    per_rank = {} if len(ranks) == 1 else {
        names.RANKS: len(ranks), names.RANK_ROWS: [r.rows for r in ranks],
        names.RANK_ROW_TOKENS: [r.row_tokens for r in ranks], names.RANK_FORWARD_PASSES: [r.forward_passes
                                                                                          for r in ranks],
        names.RANK_PADDING_MICROBATCHES: [r.padding for r in ranks],
        names.RANK_PEAK_MEM_MB: [round(p, 1) for p, _ in peaks]}
    return {
        names.SELECTIVE_SUFFIX_LOGITS: bool(spec.selective_logits), **t.branches,
        names.COMPILE_MODE: spec.selective.compile_mode, names.COMPILE_FALLBACK_REASON: t.fallback_reason,
        names.LOSS: sum(term.loss for term in t.terms.values()), names.ROWS: t.rows,
        **term_metrics(spec, t, ctx),
        names.ROW_TOKENS: t.row_tokens, names.PADDED_TOKENS: t.padded_tokens,
        names.TREE_PACKING: spec.tree_packing, names.TREE_BATCHES: t.tree_batches,
        names.TREE_UNIQUE_TOKENS: t.tree_unique_tokens, names.TREE_ROW_TOKENS: t.tree_row_tokens,
        names.TREE_TOKEN_RATIO: (t.tree_unique_tokens / t.tree_row_tokens if t.tree_row_tokens else None),
        names.TREE_FALLBACK_BATCHES: t.tree_fallback, names.TREE_FALLBACK_REASON: t.tree_fallback_reason,
        names.GRAD_NORM: grad_norm,
        names.GRAD_CLIPPED: bool(spec.max_grad_norm is not None and grad_norm > spec.max_grad_norm),
        names.OPTIMIZER_STEPPED: stepped, names.OPTIMIZER_STEPS: int(stepped),
        names.NONFINITE_GRAD_SKIPS: int(not stepped),
        names.LR: trainer.scheduler.get_last_lr()[0],
        names.FORWARD_PASSES: t.forward_passes, names.MICROBATCHES: t.microbatches,
        names.LM_HEAD_SKIPPED_MICROBATCHES: t.skipped,
        names.FORWARD_PASSES_PER_MICROBATCH: t.forward_passes / max(trained, 1),
        names.CONTEXT_ROWS_CROPPED: t.crop.rows_cropped, names.CONTEXT_TOKENS_REMOVED: t.crop.tokens_removed,
        names.SAVE_ON_CPU: bool(spec.memory.save_on_cpu),
        names.SAVE_ON_CPU_OFFLOADED_TENSORS: t.offload.tensors,
        names.SAVE_ON_CPU_OFFLOADED_MB: t.offload.bytes / 2**20,
        names.STEP_TIME_S: seconds, names.REFERENCE_FORWARD_S: reference_seconds, names.PEAK_MEM_MB: peak,
        names.PEAK_MEM_SOURCE: source, **per_rank,
    }


def term_metrics(spec: TrainerSpec, totals: StepTotals, ctx: StepContext) -> dict[str, Any]:
    """Every loss term's own metrics; two terms never write one name."""
    out: dict[str, Any] = {}
    for term in TERMS:
        metrics = term.metrics(spec, totals.terms[term.name], ctx)
        clash = out.keys() & metrics.keys()
        if clash:
            raise ValueError(f"loss term {term.name!r} writes metric(s) {sorted(clash)} another term writes")
        out.update(metrics)
    return out


def audit_logprobs(trainer: TrainerView, rows: list[EchoRow], temperature: float) -> list[list[float]]:
    """No-grad per-token log-probs at `temperature` of every action and ECHO token (0.0 elsewhere), in row
    order."""
    model = trainer.model
    was_training = model.training
    model.eval()
    try:
        reads = [[a or w > 0.0 for a, w in zip(r.action_mask, r.echo_weights)] for r in rows]
        mbs, _ = build_microbatches(rows, micro_batch_tokens=trainer.spec.micro_batch_tokens, weights={},
                                    reads=reads, device=trainer.device,
                                    by_prefix=trainer.spec.tree_packing != "off",
                                    trie_cost=trie_planner(trainer, rows))
        out: list[list[float]] = [[] for _ in rows]
        for mb in mbs:
            lp, _ = microbatch_logprobs(trainer, mb, temperature)
            for b, i in enumerate(mb.row_index):
                out[i] = [0.0] + lp[b, :len(rows[i]) - 1].tolist()
        trainer.parts.counter.take()
        return out
    finally:
        model.train(was_training)
