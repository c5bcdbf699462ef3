"""Loss terms own their targets (trainers/terms.py): a term whose targets are of a kind no other term trains
(per-token weights on quaero's corrective messages) is one subclass added to TERMS. The microbatches' weights,
the selective path's targets and the context crop's first target all come from it, and it trains through the
real step on the small Qwen3, in the one forward, beside the RL and ECHO terms it leaves unchanged."""
from __future__ import annotations

import random

import pytest
import torch
from fixtures.small_model import V, make_spec

from quaero.rows import EchoRow, Span
from trainers import loss, step, terms
from trainers.local import LocalTrainer


class CorrectiveNLL(terms.LossTerm):
    """The weighted NLL of quaero's corrective messages, each message's k-th token weighted 1 / (k + 1)."""

    name = "corrective"

    def row_weights(self, spec, row, ctx):
        out = [0.0] * len(row)
        for s in row.spans:
            if s.kind == "corrective":
                out[s.start:s.end] = [1.0 / (k + 1) for k in range(s.end - s.start)]
        return out

    def row_scales(self, spec, rows, counts, ctx):
        return [1.0 / max(sum(counts), 1)] * len(rows)

    def loss(self, spec, mb, lp, ctx):
        weights = mb.weights[self.name][:, 1:]
        return loss.nll_loss(lp, weights != 0, mb.scales[self.name], weights=weights), terms.NoStats()

    def metrics(self, spec, total, ctx):
        return {"corrective_loss": total.loss, "corrective_tokens": total.tokens}


def _row(seed: int, advantage: float) -> EchoRow:
    """[prompt][malformed action, advantage 0][corrective][action][env][prompt]: the corrective message is
    the row's first target of any kind."""
    rng = random.Random(seed)
    layout = [("prompt", 30 + seed), ("action", 4), ("corrective", 8), ("action", 5), ("env", 6),
              ("prompt", 3)]
    spans, ids, adv, echo = [], [], [], []
    for k, (kind, n) in enumerate(layout):
        spans.append(Span(kind, len(ids), len(ids) + n))
        ids += [rng.randrange(V) for _ in range(n)]
        adv += [advantage if kind == "action" and k == 3 else 0.0] * n
        echo += [1.0 if kind == "env" else 0.0] * n
    return EchoRow(ids, spans, adv, echo, [0.0] * len(ids))


ROWS = [_row(0, 1.0), _row(1, -0.5)]


def _reference(trainer: LocalTrainer, rows: list[EchoRow]) -> tuple[float, int]:
    """The term's loss from the full-vocabulary log-probs of the weights before the step, and its targets."""
    term, total, count = CorrectiveNLL(), 0.0, 0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r.input_ids])
            logits = trainer.model(ids).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
            w = term.row_weights(trainer.spec, r, None)[1:]
            total += sum(-wi * float(x) for wi, x in zip(w, lp) if wi)
            count += sum(1 for wi in w if wi)
    return total / count, count


def test_a_term_with_a_new_target_kind_trains_through_the_real_step(small_model_dir, monkeypatch):
    plain = LocalTrainer(make_spec(small_model_dir), "cpu").train_step(ROWS)
    monkeypatch.setattr(step, "TERMS", (*terms.TERMS, CorrectiveNLL()))
    trainer = LocalTrainer(make_spec(small_model_dir), "cpu")
    expected, count = _reference(trainer, ROWS)
    m = trainer.train_step(ROWS)
    # its targets reached the selective path (a token outside it scores 0, and the loss would be 0)
    assert m["corrective_tokens"] == count == 16 and m["forward_passes_per_microbatch"] == 1
    assert m["corrective_loss"] == pytest.approx(expected, rel=1e-5) and expected > 0
    assert m["loss"] == pytest.approx(m["rl_loss"] + m["echo_loss"] + m["corrective_loss"], rel=1e-6)
    for name in ("rl_loss", "echo_loss", "action_tokens", "echo_tokens", "sampler_logprob_gap_max"):
        assert m[name] == pytest.approx(plain[name], rel=1e-6), name
    assert m["grad_norm"] != plain["grad_norm"]  # its gradient reached the weights


def test_the_crop_keeps_context_before_a_new_terms_first_target(small_model_dir, monkeypatch):
    """`train_supervised_context_tokens` = K keeps K tokens before the row's first target of any term: here
    the corrective message (at 34 + seed), before the first action with an advantage (at 42 + seed)."""
    spec = make_spec(small_model_dir, memory={"supervised_context_tokens": 4})
    before = LocalTrainer(spec, "cpu").train_step(ROWS)
    assert before["context_tokens_removed"] == (42 - 4) + (43 - 4)
    monkeypatch.setattr(step, "TERMS", (*terms.TERMS, CorrectiveNLL()))
    m = LocalTrainer(spec, "cpu").train_step(ROWS)
    assert m["context_rows_cropped"] == 2 and m["context_tokens_removed"] == (34 - 4) + (35 - 4)
    assert m["corrective_tokens"] == 16 and m["corrective_loss"] > 0
