"""The strict shared-forward train step, shared by the `local` and `unsloth` backends.

Per microbatch: ONE backbone forward -> one shifted log-prob tensor `lp` [B, L-1] (selective path) ->
the RL (or SFT) term and the ECHO term both read `lp` -> ONE backward. Gradients accumulate over the
microbatches; then grad-norm clipping (`[backend] max_grad_norm`, always applied when set) and ONE
optimizer step. Each term is normalised by its own step-wide token count (trainers/loss.py), so the
microbatch split never changes the result. A microbatch without targets does no forward at all.

Temperature: `lp` is log_softmax(logits / T) with T = `[sampler] temperature`, so the importance ratio
compares the trainer with the distribution the sampler drew from. The ECHO and SFT terms read the
same tensor (one LM-head pass), so at T != 1 they train the tempered distribution too; at the
default T = 1 all three are the model's own distribution.
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import Tensor

from quaero.proofs import BRANCH_COUNTERS, COMPILE_FALLBACK_REASON, COMPILE_MODE, SELECTIVE_SUFFIX_LOGITS
from quaero.rows import EchoRow
from trainers.batch import Microbatch, build_microbatches
from trainers.forward import SharedForwardError
from trainers.loss import PolicyStats, nll_loss, policy_gradient_loss
from trainers.memory import OffloadStats, peak_mem_mb, reset_peak, saved_tensors_offload
from trainers.selective import SelectiveInfo, full_logprobs, selected_logprobs


def microbatch_logprobs(backend, mb: Microbatch) -> tuple[Tensor, SelectiveInfo]:  # [B, L-1] fp32
    """The microbatch's one forward and its target log-probs (selective when enabled and possible)."""
    opts, parts = backend.cfg.backend.options, backend.parts
    T = backend.cfg.sampler.temperature
    if not opts.train_selective_suffix_logits or not parts.selective_ok:
        # the model's own full logits: "dense" by choice, "fallback" when selective was asked for
        logits = parts.logits(mb.input_ids, mb.attention_mask)
        branch = "fallback" if opts.train_selective_suffix_logits else "dense"
        return full_logprobs(logits, mb.input_ids, mb.target_mask, temperature=T), SelectiveInfo(branch=branch)
    hidden = parts.hidden_states(mb.input_ids, mb.attention_mask)
    return selected_logprobs(
        hidden, parts.lm_head, mb.input_ids, mb.target_mask, temperature=T,
        chunk_size=opts.train_logprob_chunk_size, compile_mode=opts.train_compile_selective_ce,
        compile_min_tokens=opts.train_compile_selective_ce_min_tokens, logit_transform=parts.transform,
        dense_min_density=opts.train_selective_dense_min_density,
        suffix_max_bytes=opts.train_selective_suffix_max_bytes)


def _count_branch(counts: dict, info: SelectiveInfo) -> None:
    for name, counted in BRANCH_COUNTERS.items():
        counts[name] += int(counted(info))


def train_step(backend, rows: list[EchoRow], *, sft: bool) -> dict[str, Any]:
    cfg, parts, model = backend.cfg, backend.parts, backend.model
    opts = cfg.backend.options
    t0 = time.perf_counter()
    reset_peak(backend.device)
    was_training = model.training
    model.train()
    mbs, crop = build_microbatches(rows, micro_batch_tokens=cfg.backend.micro_batch_tokens, sft=sft,
                                   echo=cfg.echo.enabled, context_tokens=opts.train_supervised_context_tokens,
                                   device=backend.device)
    n_rl = sum(int(mb.rl_mask.sum()) for mb in mbs)
    n_echo = sum(int(mb.echo_mask.sum()) for mb in mbs)
    counts = dict.fromkeys(BRANCH_COUNTERS, 0)
    totals = {"rl": 0.0, "echo": 0.0}
    pg = PolicyStats()
    fallback_reason, forwards, skipped = "", 0, 0
    offload = OffloadStats()
    backend.optimizer.zero_grad(set_to_none=True)
    parts.counter.take()
    for mb in mbs:
        if not mb.target_mask.any():
            skipped += 1  # nothing reads a log-prob here: no forward, no LM head, no backward
            continue
        with saved_tensors_offload(backend.device, enabled=opts.train_save_on_cpu,
                                   pin_memory=opts.train_save_on_cpu_pin_memory,
                                   min_numel=opts.train_save_on_cpu_min_numel, stats=offload):
            lp, info = microbatch_logprobs(backend, mb)
            rl_mask, echo_mask = mb.rl_mask[:, 1:], mb.echo_mask[:, 1:]
            if sft:
                rl_term = nll_loss(lp, rl_mask, n_rl)
            else:
                rl_term, st = policy_gradient_loss(lp, mb.sampler_logprobs[:, 1:], mb.advantages[:, 1:], rl_mask,
                                                   n_rl, cfg.training.clip_eps)
                pg.tokens += st.tokens
                pg.ratio_sum += st.ratio_sum
                pg.clipped += st.clipped
                pg.gap_sum += st.gap_sum
                pg.gap_max = max(pg.gap_max, st.gap_max)
            echo_term = nll_loss(lp, echo_mask, n_echo, weights=mb.echo_weights[:, 1:], scale=cfg.echo.weight)
        n_fwd = parts.counter.take()
        if n_fwd != 1:
            raise SharedForwardError(f"backend {backend.name!r}: the RL and ECHO terms of a microbatch came from "
                                     f"{n_fwd} forward passes; strict shared forward needs exactly 1")
        forwards += n_fwd
        _count_branch(counts, info)
        if opts.train_compile_selective_ce != "off" and info.branch != "none":
            fallback_reason = info.fallback_reason  # last writer this step; "" once compiled CE ran
        (rl_term + echo_term).backward()
        totals["rl"] += float(rl_term.detach())
        totals["echo"] += float(echo_term.detach())

    max_norm = cfg.backend.max_grad_norm
    grad_norm = float(torch.nn.utils.clip_grad_norm_(backend.trainable, max_norm if max_norm else math.inf))
    stepped = math.isfinite(grad_norm)
    if stepped:  # a non-finite gradient never reaches the weights
        backend.optimizer.step()
        backend.scheduler.step()
    backend.optimizer.zero_grad(set_to_none=True)
    model.train(was_training)
    peak, source = peak_mem_mb(backend.device)
    return {
        SELECTIVE_SUFFIX_LOGITS: bool(opts.train_selective_suffix_logits), **counts,
        COMPILE_MODE: opts.train_compile_selective_ce, COMPILE_FALLBACK_REASON: fallback_reason,
        "loss": totals["rl"] + totals["echo"],
        "rl_loss": 0.0 if sft else totals["rl"], "sft_loss": totals["rl"] if sft else 0.0,
        "echo_loss": totals["echo"],
        "action_tokens": n_rl, "echo_tokens": n_echo, "rows": len(rows),
        "row_tokens": sum(mb.tokens for mb in mbs), "padded_tokens": sum(mb.input_ids.numel() for mb in mbs),
        "grad_norm": grad_norm, "grad_clipped": bool(max_norm is not None and grad_norm > max_norm),
        "optimizer_stepped": stepped, "nonfinite_grad_skips": int(not stepped),
        "lr": backend.scheduler.get_last_lr()[0],
        "forward_passes": forwards, "microbatches": len(mbs), "lm_head_skipped_microbatches": skipped,
        "forward_passes_per_microbatch": forwards / max(len(mbs) - skipped, 1),
        "sampler_logprob_gap_mean": pg.gap_sum / pg.tokens if pg.tokens and not sft else 0.0,
        "sampler_logprob_gap_max": pg.gap_max if not sft else 0.0,
        "importance_ratio_mean": pg.ratio_sum / pg.tokens if pg.tokens else 1.0,
        "clip_fraction": pg.clipped / pg.tokens if pg.tokens else 0.0,
        "context_rows_cropped": crop.rows_cropped, "context_tokens_removed": crop.tokens_removed,
        "local_train_save_on_cpu": bool(opts.train_save_on_cpu),
        "save_on_cpu_offloaded_tensors": offload.tensors, "save_on_cpu_offloaded_mb": offload.bytes / 2**20,
        "step_time_s": time.perf_counter() - t0, "peak_mem_mb": peak, "peak_mem_source": source,
    }


def audit_logprobs(backend, rows: list[EchoRow]) -> list[list[float]]:
    """No-grad per-token log-probs of every action and ECHO token (0.0 elsewhere), in row order."""
    model = backend.model
    was_training = model.training
    model.eval()
    try:
        mbs, _ = build_microbatches(rows, micro_batch_tokens=backend.cfg.backend.micro_batch_tokens, sft=True,
                                    echo=True, device=backend.device)
        out: list[list[float]] = [[] for _ in rows]
        for mb in mbs:
            lp, _ = microbatch_logprobs(backend, mb)
            for b, i in enumerate(mb.row_index):
                out[i] = [0.0] + lp[b, :len(rows[i]) - 1].tolist()
        backend.parts.counter.take()
        return out
    finally:
        model.train(was_training)
