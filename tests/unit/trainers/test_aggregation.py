"""Loss aggregation (RL: token_mean, sequence_mean, constant) and ECHO normalisation (token, sequence) and
λ schedules: each gives the loss a float64 reference computes from the same log-probs, to 1e-6 relative."""
from __future__ import annotations

import math
import random

import pytest
import torch
from fixtures.small_model import V, make_spec

from quaero.config import EchoConfig
from quaero.rows import EchoRow, Span
from trainers.aggregation import echo_scales, rl_scales
from trainers.local import LocalTrainer
from trainers.terms import TERMS, StepContext, row_targets


def _row(seed: int, advantage: float, actions: list[int], envs: list[int], episode: str | None) -> EchoRow:
    """[prompt 12] then per turn [action a][env e][prompt 5]: rows of different RL and ECHO lengths."""
    rng = random.Random(seed)
    layout = [("prompt", 12)]
    for a, e in zip(actions, envs):
        layout += [("action", a), ("env", e), ("prompt", 5)]
    spans, ids, adv, echo, slp = [], [], [], [], []
    for kind, n in layout:
        spans.append(Span(kind, len(ids), len(ids) + n))
        ids += [rng.randrange(V) for _ in range(n)]
        adv += [advantage if kind == "action" else 0.0] * n
        echo += [rng.choice([0.5, 1.0]) if kind == "env" else 0.0] * n
        slp += [0.0] * n
    return EchoRow(ids, spans, adv, echo, slp, {"episode": episode} if episode else {})


def _rows() -> list[EchoRow]:
    # episode "a" spans two rows (a packing break); "b" and "c" one each; "d" has no RL tokens (A = 0)
    return [_row(0, 1.0, [9, 3], [4, 2], "a"), _row(1, 1.0, [2], [11], "a"), _row(2, -0.5, [20, 7], [3, 3],
                                                                                  "b"),
            _row(3, 0.25, [1], [30], "c"), _row(4, 0.0, [5], [6], "d")]


def _counts(rows: list[EchoRow], *, sft: bool) -> tuple[list[int], list[int]]:
    """Per row: the RL (or SFT) term's and the ECHO term's targets, as the step counts them
    (trainers/terms.py)."""
    targets = row_targets(TERMS, make_spec("unused"), rows, StepContext(sft=sft, echo_weight=0.3))
    return targets.counts["policy"], targets.counts["echo"]


def _near_policy(trainer, rows: list[EchoRow]) -> tuple[list[EchoRow], list[list[float]]]:
    """Rows whose sampler log-probs sit 0.05 below the trainer's: ratio exp(0.05), inside the clip range."""
    lps = trainer.logprobs(rows)
    out = [EchoRow(r.input_ids, r.spans, r.advantages, r.echo_weights,
                   [lp - 0.05 if a else 0.0 for lp, a in zip(lps[i], r.action_mask)], r.meta) for i,
           r in enumerate(rows)]
    return out, lps


def _reference(rows, lps, *, aggregation: str, normalization: str, constant: int, lam: float) -> tuple[float,
                                                                                                       float]:
    """(rl_loss, echo_loss) in float64 from the definitions in trainers/aggregation.py."""
    ratio = math.exp(0.05)
    rl_tok: dict[str, list[float]] = {}
    echo_tok: dict[str, list[float]] = {}
    for i, r in enumerate(rows):
        key = r.meta.get("episode", f"row{i}")
        for j in range(1, len(r)):
            if r.action_mask[j] and r.advantages[j] != 0.0:
                rl_tok.setdefault(key, []).append(-ratio * r.advantages[j])
            if r.echo_weights[j] > 0:
                echo_tok.setdefault(key, []).append(-r.echo_weights[j] * float(lps[i][j]))
    everything = [x for v in rl_tok.values() for x in v]
    if aggregation == "token_mean":
        rl = sum(everything) / len(everything)
    elif aggregation == "sequence_mean":
        rl = sum(sum(v) / len(v) for v in rl_tok.values()) / len(rl_tok)
    else:
        rl = sum(everything) / constant
    if normalization == "token":
        echo = lam * sum(x for v in echo_tok.values() for x in v) / sum(len(v) for v in echo_tok.values())
    else:
        echo = lam * sum(sum(v) / len(v) for v in echo_tok.values()) / len(echo_tok)
    return rl, echo


@pytest.mark.parametrize("aggregation,normalization", [
    ("token_mean", "token"), ("sequence_mean", "token"), ("constant", "token"),
    ("token_mean", "sequence"), ("sequence_mean", "sequence")])
@pytest.mark.parametrize("micro_batch_tokens", [10**6, 60])  # one microbatch, or one row each
def test_each_aggregation_equals_its_float64_reference(small_model_dir, aggregation, normalization,
                                                       micro_batch_tokens):
    spec = make_spec(small_model_dir, loss_aggregation=aggregation, loss_constant=1000,
                     echo_normalization=normalization, micro_batch_tokens=micro_batch_tokens)
    trainer = LocalTrainer(spec, "cpu")
    rows, lps = _near_policy(trainer, _rows())
    m = trainer.train_step(rows)
    rl, echo = _reference(rows, lps, aggregation=aggregation, normalization=normalization, constant=1000,
                          lam=0.3)
    assert m["rl_loss"] == pytest.approx(rl, rel=1e-6)
    assert m["echo_loss"] == pytest.approx(echo, rel=1e-6)
    assert m["loss_aggregation"] == aggregation and m["echo_normalization"] == normalization


def test_the_modes_differ_on_these_rows():
    """The reference rows separate the modes: a test of one could not pass for another."""
    rows = _rows()
    rl, echo = _counts(rows, sft=False)
    token, seq = rl_scales(rows, rl, sft=False), rl_scales(rows, rl, sft=False, aggregation="sequence_mean")
    assert len({round(s, 9) for s in seq[:4]}) == 3 and len(set(token)) == 1 and seq[4] == 0.0
    assert echo_scales(rows, echo) != echo_scales(rows, echo, normalization="sequence")
    sft, _ = _counts(rows, sft=True)
    mean = rl_scales(rows, sft, sft=True)
    assert rl_scales(rows, sft, sft=True, aggregation="constant", constant=7) == mean  # SFT: a mean
    with pytest.raises(ValueError, match="normaliser >= 1"):
        rl_scales(rows, rl, sft=False, aggregation="constant", constant=0)


def test_a_step_echo_weight_scales_the_echo_term_and_not_the_rl_term(small_model_dir):
    rows = _rows()
    losses = []
    for lam in (0.3, 0.075, 0.0):
        trainer = LocalTrainer(make_spec(small_model_dir), "cpu")
        m = trainer.train_step(rows, echo_weight=lam)
        losses.append((m["rl_loss"], m["echo_loss"], m["echo_weight"]))
    (rl, echo, w), (rl2, echo2, w2), (rl3, echo3, w3) = losses
    assert (w, w2, w3) == (0.3, 0.075, 0.0)
    assert echo2 == pytest.approx(echo / 4, rel=1e-6) and echo3 == 0.0
    assert rl2 == pytest.approx(rl, rel=1e-6) and rl3 == pytest.approx(rl, rel=1e-6)


@pytest.mark.parametrize("schedule,steps,expected", [
    ("constant", 0, [0.2, 0.2, 0.2, 0.2]),
    ("warmup", 0, [0.05, 0.1, 0.15, 0.2]),
    ("warmup", 2, [0.1, 0.2, 0.2, 0.2]),
    ("decay", 0, [0.2, 0.15, 0.1, 0.05]),
    ("decay", 2, [0.2, 0.1, 0.0, 0.0]),
])
def test_echo_schedules(schedule, steps, expected):
    cfg = EchoConfig(weight=0.2, schedule=schedule, schedule_steps=steps)
    assert [cfg.weight_at(k, 4) for k in range(1, 5)] == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert EchoConfig(include_scaffold=True).world_loss_target == "all"
    assert EchoConfig().world_loss_target == "env_only"


def test_sequence_mean_gradient_equals_float64_reference(small_model_dir):
    """Beyond the value: the gradient of the sequence-mean RL term matches autograd of the float64
    reference."""
    trainer = LocalTrainer(make_spec(small_model_dir, loss_aggregation="sequence_mean", echo=False, lr=0.0,
                                     max_grad_norm=None, micro_batch_tokens=60), "cpu")
    rows, _ = _near_policy(trainer, _rows())
    head = trainer.parts.lm_head.weight
    captured = {}
    hook = head.register_hook(lambda g: captured.__setitem__("g", captured.get("g", 0) + g.detach().clone()))
    trainer.train_step(rows)
    hook.remove()
    # reference: the same loss from full-vocabulary log-probs in float64, one row at a time
    model = trainer.model.double()
    ref = torch.zeros_like(head, dtype=torch.float64)
    scales = rl_scales(rows, _counts(rows, sft=False)[0], sft=False, aggregation="sequence_mean")
    for r, scale in zip(rows, scales):
        ids = torch.tensor([r.input_ids])
        model.zero_grad(set_to_none=True)
        logp = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        mask = torch.tensor([bool(r.action_mask[j] and r.advantages[j]) for j in range(1, len(r))])
        adv = torch.tensor(r.advantages[1:], dtype=torch.float64)
        slp = torch.tensor(r.sampler_logprobs[1:], dtype=torch.float64)
        loss = (-(torch.exp(logp - slp) * adv)[mask]).sum() * scale
        loss.backward()
        ref += trainer.parts.lm_head.weight.grad
    got = captured["g"].double()
    assert ref.norm() > 0 and float((got - ref).norm() / ref.norm()) < 1e-5  # fp32 step vs float64 reference


@pytest.mark.parametrize("schedule,expected", [("constant", [0.02] * 4), ("decay", [0.02, 0.015, 0.01,
                                                                                    0.005])])
def test_echo_rl_weight_replaces_the_weight_of_the_rl_steps_only(schedule, expected):
    cfg = EchoConfig(weight=0.2, rl_weight=0.02, schedule=schedule)
    assert [cfg.weight_at(k, 4) for k in range(1, 5)] == pytest.approx(expected, rel=1e-12)
    assert cfg.weight == 0.2  # what the warm start's steps use (quaero/recipe/train.py: run_step)
