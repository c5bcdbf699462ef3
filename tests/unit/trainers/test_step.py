"""The local trainer's step: strict shared forward, loss normalisation, clipping, branches, sampler gap."""
import math

import pytest
import torch
from fixtures.small_model import V, make_spec, rows

from benchmarks.smoke import SMOKE_KEYS, sparse_row
from quaero.rows import EchoRow
from quaero.telemetry.names import SELECTIVE_METRICS
from trainers.forward import SharedForwardError
from trainers.local import LocalTrainer


def test_sparse_rows_prove_the_branch_metrics_with_one_forward_per_microbatch(small_model_dir):
    b = LocalTrainer(make_spec(small_model_dir, micro_batch_tokens=200), "cpu")  # one row each
    before = {k: v.clone() for k, v in b.model.state_dict().items()}
    m = b.train_step(rows())
    assert set(SMOKE_KEYS) <= set(m) and set(SELECTIVE_METRICS) <= set(m)
    assert isinstance(m["local_train_selective_suffix_logits"], bool)
    assert (
        m["local_train_compile_selective_ce_mode"] == "off"
        and m["local_train_compile_selective_ce_fallback_reason"] == ""
    )
    assert m["microbatches"] == 4 and m["forward_passes"] == 4 and m["forward_passes_per_microbatch"] == 1
    assert m["local_train_selective_sparse_suffix_skips"] == 4
    assert m["local_train_selective_hidden_logprob_batches"] == 4
    assert m["local_train_selective_fallback_logprob_batches"] == 0
    assert m["local_train_selective_suffix_logprob_batches"] == 0
    assert m["action_tokens"] == 4 * 14 and m["echo_tokens"] == 4 * 22
    assert m["echo_loss"] > 0 and math.isfinite(m["rl_loss"]) and m["optimizer_stepped"]
    assert any(not torch.equal(before[k], v) for k, v in b.model.state_dict().items())


def test_a_second_forward_in_a_microbatch_is_refused(small_model_dir, monkeypatch):
    """Fault injection: an ECHO term computed from its own forward must fail the step."""
    from trainers import step

    b = LocalTrainer(make_spec(small_model_dir), "cpu")
    real = step.microbatch_logprobs

    def separate_echo_forward(trainer, mb, temperature):
        trainer.parts.hidden_states(mb.input_ids, mb.attention_mask)  # a second, separate forward
        return real(trainer, mb, temperature)

    monkeypatch.setattr(step, "microbatch_logprobs", separate_echo_forward)
    with pytest.raises(SharedForwardError, match="2 forward passes"):
        b.train_step(rows(2))


def _losses(model_dir, rs, **kw):
    b = LocalTrainer(make_spec(model_dir, **kw), "cpu")
    m = b.train_step(rs)
    return m, b


@pytest.mark.parametrize("variant", [
    {"micro_batch_tokens": 200},  # one row per microbatch
    {"gradient_checkpointing": True},  # recomputes layers in backward, still one counted forward
    {"selective": {"chunk_size": 5}},  # chunked recompute
    {"selective_logits": False},  # full logits, no selection
    {"selective": {"compile_mode": "auto", "compile_min_tokens": 1}},
    {"selective": {"dense_min_density": 0.01, "suffix_max_bytes": 2**40}},
])
def test_every_path_and_split_gives_the_same_step(small_model_dir, variant):
    rs = rows(3)
    ref, _ = _losses(small_model_dir, rs)
    got, _ = _losses(small_model_dir, rs, **variant)
    for key in ("rl_loss", "echo_loss", "grad_norm"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    policy = variant.get("selective", {})
    if variant.get("selective_logits") is False:
        assert got["local_train_selective_dense_logprob_batches"] == got["microbatches"]
    if "chunk_size" in policy:
        assert got["local_train_selective_chunked_logprob_batches"] == got["microbatches"]
    if policy.get("compile_mode") == "auto":
        assert got["local_train_compile_selective_ce_fallback_reason"] == "non_cuda"
        assert got["local_train_selective_compiled_ce_batches"] == 0
    if "dense_min_density" in policy:
        assert got["local_train_selective_suffix_logprob_batches"] == got["microbatches"]
        assert got["local_train_selective_sparse_suffix_skips"] == 0


def test_each_term_is_normalised_by_its_own_token_count(small_model_dir):
    b = LocalTrainer(make_spec(small_model_dir), "cpu")
    rs = rows(2)
    lps = b.logprobs(rs)
    # on-policy rows (sampler logprobs = the trainer's) make the ratio exactly 1
    on_policy = [EchoRow(r.input_ids, r.spans, r.advantages, r.echo_weights,
                         [lp if a else 0.0 for lp, a in zip(lps[i], r.action_mask)]) for i,
                 r in enumerate(rs)]
    rl_tok = [(r.advantages[j], lps[i][j]) for i,
                                         r in enumerate(rs) for j in range(len(r)) if r.advantages[j]]
    echo_tok = [lps[i][j] for i, r in enumerate(rs) for j in range(len(r)) if r.echo_weights[j] > 0]
    m = b.train_step(on_policy)
    assert m["sampler_logprob_gap_max"] < 1e-5 and m["importance_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["rl_loss"] == pytest.approx(-sum(a for a, _ in rl_tok) / len(rl_tok), abs=1e-6)
    assert m["echo_loss"] == pytest.approx(0.3 * -sum(echo_tok) / len(echo_tok), rel=1e-5)
    # ECHO on or off, the RL term is the same (its own denominator)
    b2 = LocalTrainer(make_spec(small_model_dir, echo=False), "cpu")
    m2 = b2.train_step(on_policy)
    assert m2["rl_loss"] == pytest.approx(m["rl_loss"], rel=1e-6) and m2["echo_loss"] == 0.0


@pytest.mark.hostile
def test_sft_mode_trains_action_nll_and_keeps_echo(small_model_dir):
    b = LocalTrainer(make_spec(small_model_dir), "cpu")
    demo = [sparse_row(i, 0.0, vocab=V, context=60) for i in range(2)]  # oracle demos: no advantage
    lps = b.logprobs(demo)
    act = [lps[i][j] for i, r in enumerate(demo) for j in range(len(r)) if r.action_mask[j]]
    m = b.train_step(demo, sft=True)
    assert m["sft_loss"] == pytest.approx(-sum(act) / len(act), rel=1e-5)
    assert m["rl_loss"] == 0.0 and m["echo_loss"] > 0
    # nothing was sampled: no gap, no ratio measured, and none claimed
    assert m["sampler_logprob_gap_max"] is m["sampler_logprob_gap_mean"] is m["importance_ratio_mean"] is None


def test_an_sft_step_scores_at_temperature_1_and_an_rl_step_at_the_samplers(small_model_dir):
    """The sampler's temperature is the importance ratio's: it reaches RL steps only. The warm start's
    loss at T 0.7 equals its loss at T 1 (at 0.7 it was the tempered NLL, a 1/0.7-times larger gradient)."""
    demo = [sparse_row(i, 0.0, vocab=V, context=60) for i in range(2)]
    cold = LocalTrainer(make_spec(small_model_dir, temperature=1.0), "cpu")
    act = [lp for r, lps in zip(demo, cold.logprobs(demo)) for lp, a in zip(lps, r.action_mask) if a]
    warm = LocalTrainer(make_spec(small_model_dir, temperature=0.7), "cpu")
    sft = warm.train_step(demo, sft=True)
    assert sft["sft_loss"] == pytest.approx(-sum(act) / len(act), rel=1e-5)
    # rows "sampled" at T 0.7: their sampler log-probs are the T-0.7 trainer's own; its RL step sees no gap
    sampled = [sparse_row(i, 1.0, vocab=V, context=60) for i in range(2)]
    for r, lps in zip(sampled, LocalTrainer(make_spec(small_model_dir, temperature=0.7),
                                            "cpu").logprobs(sampled)):
        r.sampler_logprobs = [lp if a else 0.0 for lp, a in zip(lps, r.action_mask)]
    gaps = {t: LocalTrainer(make_spec(small_model_dir, temperature=t), "cpu").train_step(sampled)[
        "sampler_logprob_gap_max"] for t in (0.7, 1.0)}
    assert gaps[0.7] < 1e-4 and gaps[1.0] > 0.01, gaps


def test_grad_norm_clipping_is_honoured(small_model_dir):
    b = LocalTrainer(make_spec(small_model_dir, max_grad_norm=1e-3), "cpu")
    seen = []
    b.optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in b.trainable if p.grad is not None]))))
    m = b.train_step(rows(2))
    assert m["grad_clipped"] and m["grad_norm"] > 1e-3
    assert seen and float(seen[0]) <= 1e-3 * (1 + 1e-4)


def test_microbatch_without_targets_does_no_forward(small_model_dir):
    b = LocalTrainer(make_spec(small_model_dir, echo=False, micro_batch_tokens=200), "cpu")
    flat = [sparse_row(i, 0.0, vocab=V, context=40) for i in range(2)]  # uniform group, ECHO off
    m = b.train_step(flat)
    assert m["forward_passes"] == 0 and m["lm_head_skipped_microbatches"] == m["microbatches"] == 2
    assert m["local_train_selective_fallback_logprob_batches"] == 0 and m["grad_norm"] == 0.0


def test_trainer_imports_no_app_config():
    """A trainer is built from a TrainerSpec alone: importing every trainer module loads no quaero.config."""
    import subprocess
    import sys

    code = ("import sys, trainers.base, trainers.local, trainers.step, trainers.registry; "
            "print('quaero.config' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _with_sampler_logprobs(rs, lps, offset):
    """The rows with sampler log-probs = the trainer's own + `offset` on action tokens."""
    return [EchoRow(r.input_ids, r.spans, r.advantages, r.echo_weights,
                    [lp + offset if a else 0.0 for lp, a in zip(lps[i], r.action_mask)]) for i,
            r in enumerate(rs)]


@pytest.mark.hostile
def test_sampler_gap_covers_action_tokens_whose_advantage_is_zero(small_model_dir):
    """An all-equal group trains only ECHO; the sampler-vs-trainer gap still reads every sampled action
    token."""
    b = LocalTrainer(make_spec(small_model_dir), "cpu")
    flat = [sparse_row(i, 0.0, vocab=V, context=60) for i in range(2)]  # every advantage 0
    lps = b.logprobs(flat)
    before = {k: v.clone() for k, v in b.model.state_dict().items()}
    m = b.train_step(_with_sampler_logprobs(flat, lps, -0.5))
    assert (
        m["action_tokens"] == 0
        and m["rl_loss"] == 0.0
        and m["echo_loss"] > 0
        and m["importance_ratio_mean"] is None
    )
    assert m["sampler_logprob_gap_mean"] == pytest.approx(0.5, abs=1e-4)
    assert m["sampler_logprob_gap_max"] == pytest.approx(0.5, abs=1e-4)
    # the sampler log-probs of zero-advantage tokens never reach the weights: on-policy ones give the same
    # step
    b2 = LocalTrainer(make_spec(small_model_dir), "cpu")
    b2.model.load_state_dict(before)
    m2 = b2.train_step(_with_sampler_logprobs(flat, lps, 0.0))
    assert m2["sampler_logprob_gap_max"] < 1e-5
    assert m2["echo_loss"] == pytest.approx(m["echo_loss"], rel=1e-6)
    assert all(torch.equal(v, b2.model.state_dict()[k]) for k, v in b.model.state_dict().items())


def test_a_new_loss_term_is_one_class_added_to_terms(small_model_dir, monkeypatch):
    """trainers/terms.py: a term brings its targets, its row scales, its loss and its metrics; the step adds
    its loss into the one backward (one forward still), totals it and logs its metrics, and the other terms'
    are unchanged. Here: the mean NLL of the sampled action tokens at coefficient 0.5 (a term the step never
    named)."""
    from trainers import loss, step, terms

    class ActionNLL(terms.LossTerm):
        name = "action_nll"

        def row_weights(self, spec, row, ctx):
            return [1.0 if a else 0.0 for a in row.action_mask]

        def row_scales(self, spec, rows, counts, ctx):
            return [1.0 / sum(counts)] * len(rows)

        def loss(self, spec, mb, lp, ctx):
            targets = mb.targets(self.name)[:, 1:]
            return loss.nll_loss(lp, targets, mb.scales[self.name], coef=0.5), terms.NoStats()

        def metrics(self, spec, total, ctx):
            return {"action_nll_loss": total.loss, "action_nll_tokens": total.tokens}

    rs = rows(2)
    base = LocalTrainer(make_spec(small_model_dir), "cpu")
    lps = base.logprobs(rs)
    plain = base.train_step(rs)
    monkeypatch.setattr(step, "TERMS", (*terms.TERMS, ActionNLL()))
    b = LocalTrainer(make_spec(small_model_dir), "cpu")
    m = b.train_step(rs)
    action = [lps[i][j] for i, r in enumerate(rs) for j in range(1, len(r)) if r.action_mask[j]]
    assert m["action_nll_tokens"] == len(action) and m["forward_passes_per_microbatch"] == 1
    assert m["action_nll_loss"] == pytest.approx(0.5 * -sum(action) / len(action), rel=1e-5)
    assert m["loss"] == pytest.approx(m["rl_loss"] + m["echo_loss"] + m["action_nll_loss"], rel=1e-6)
    for name in ("rl_loss", "echo_loss", "action_tokens", "echo_tokens"):
        assert m[name] == pytest.approx(plain[name], rel=1e-6), name
    assert m["grad_norm"] != plain["grad_norm"]  # its gradient reached the weights
