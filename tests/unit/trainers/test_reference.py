"""The KL penalty against a frozen reference (trainers/reference.py): each estimator's loss and gradient equal
the formula written out by hand (fp32, 1e-6); the reference's selective log-probs equal a full-vocabulary
forward of that model; it stays frozen while the policy trains; LoRA's is the base with the adapter disabled
(no copy); a checkpoint restores it exactly."""
import math

import pytest
import torch
from fixtures.small_model import make_spec, rows

from trainers.local import LocalTrainer
from trainers.reference import kl_penalty, kl_targets, per_token_kl

# each estimator of KL(π || π_ref) at one token and its derivative in lp, from the formulas (d = lp - lp_ref)
BY_HAND = {
    "k1": (lambda lp, ref: lp - ref, lambda lp, ref: 1.0),
    "k2": (lambda lp, ref: 0.5 * (lp - ref) ** 2, lambda lp, ref: lp - ref),
    "k3": (lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1.0, lambda lp, ref: 1.0 - math.exp(ref - lp)),
}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_the_penalty_and_its_gradient_equal_the_formula(estimator):
    g = torch.Generator().manual_seed(3)
    lp = (-torch.rand(3, 7, generator=g) * 3).requires_grad_()
    ref = -torch.rand(3, 7, generator=g) * 3
    mask = torch.rand(3, 7, generator=g) > 0.4
    scale = torch.tensor([[0.1], [0.25], [0.05]])
    beta = 0.04
    loss, stats = kl_penalty(lp, ref, mask, scale, beta, estimator)
    loss.backward()
    value, slope = BY_HAND[estimator]
    want_loss, want_grad, picked = 0.0, torch.zeros(3, 7), []
    for b in range(3):
        for j in range(7):
            if mask[b, j]:
                x, y = float(lp.detach()[b, j]), float(ref[b, j])
                want_loss += beta * float(scale[b, 0]) * value(x, y)
                want_grad[b, j] = beta * float(scale[b, 0]) * slope(x, y)
                picked.append(value(x, y))
    assert float(loss.detach()) == pytest.approx(want_loss, abs=1e-6)
    torch.testing.assert_close(lp.grad, want_grad, atol=1e-6, rtol=0)
    assert stats.tokens == len(picked) and stats.total == pytest.approx(sum(picked), abs=1e-5)
    assert stats.max == pytest.approx(max(picked), abs=1e-6)


def test_k3_is_zero_where_the_policy_is_the_reference_and_positive_elsewhere():
    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    assert torch.equal(per_token_kl(lp, lp.clone(), "k3"), torch.zeros(1, 3))
    assert bool((per_token_kl(lp, lp + 0.3, "k3") > 0).all())
    with pytest.raises(ValueError, match="kl_estimator='k4'"):
        per_token_kl(lp, lp, "k4")


def _full_vocab_logprobs(model, rs, temperature):
    """Per row, log_softmax(logits / T) of the whole vocabulary, gathered at each next token (EchoRow
    convention: entry j scores token j)."""
    out = []
    with torch.no_grad():
        for r in rs:
            ids = torch.tensor([r.input_ids])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()
            lp = torch.log_softmax(logits[0, :-1] / temperature, -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append([0.0, *lp.tolist()])
    return out


def _at_targets(lps, rs):
    return [[lp[j] for j, w in enumerate(kl_targets(r)) if w] for lp, r in zip(lps, rs)]


def test_the_reference_is_the_first_rl_weights_frozen_and_equals_a_full_vocabulary_forward(small_model_dir):
    rs = rows(3)
    trainer = LocalTrainer(make_spec(small_model_dir, beta=0.1, lr=2e-2, temperature=0.7), "cpu")
    before = _full_vocab_logprobs(trainer.model, rs, 0.7)  # the policy's weights, about to be frozen
    trainer.take_reference()
    assert trainer.reference is not None and trainer.reference.parts.model is not trainer.model
    first = trainer.train_step(rs)
    assert first["kl_tokens"] == sum(sum(kl_targets(r)) for r in rs)
    assert first["kl_mean"] == pytest.approx(0.0, abs=1e-6) and first["reference_forward_s"] > 0
    second = trainer.train_step(rs)  # the policy moved; the reference did not
    assert second["kl_mean"] > 1e-6 and second["kl_max"] >= second["kl_mean"]
    ref = trainer.reference.logprobs(trainer.spec, rs, 0.7, trainer.device)
    for got, want in zip(_at_targets(ref, rs), _at_targets(before, rs)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    assert all(v == 0.0 for lp, r in zip(ref, rs) for v, w in zip(lp, kl_targets(r)) if not w)
    assert not any(p.requires_grad for p in trainer.reference.parts.model.parameters())


def test_the_step_loss_adds_beta_times_the_estimate_over_its_own_targets(small_model_dir):
    rs = rows(2)
    trainer = LocalTrainer(make_spec(small_model_dir, beta=0.5, kl_estimator="k2", lr=2e-2), "cpu")
    trainer.take_reference()
    trainer.train_step(rs)  # move the policy off the reference
    policy = trainer.logprobs(rs)
    ref = trainer.reference.logprobs(trainer.spec, rs, 1.0, trainer.device)
    kl = [0.5 * (a - b) ** 2 for p, q in zip(_at_targets(policy, rs), _at_targets(ref, rs))
          for a, b in zip(p, q)]
    m = trainer.train_step(rs)
    assert m["kl_loss"] == pytest.approx(0.5 * sum(kl) / len(kl), rel=1e-4)
    assert m["kl_mean"] == pytest.approx(sum(kl) / len(kl), rel=1e-4) and m["kl_tokens"] == len(kl)
    assert m["loss"] == pytest.approx(m["rl_loss"] + m["echo_loss"] + m["kl_loss"], rel=1e-6)


def test_no_beta_no_reference_no_kl(small_model_dir):
    trainer = LocalTrainer(make_spec(small_model_dir), "cpu")
    trainer.take_reference()
    m = trainer.train_step(rows(2))
    assert trainer.reference is None and m["kl_tokens"] == 0 and m["kl_mean"] is None
    assert m["reference_forward_s"] is None and "reference" not in trainer.state_dict()


def test_a_checkpoint_restores_the_reference_exactly(small_model_dir, tmp_path):
    from quaero.recipe import checkpoint

    rs = rows(2)
    a = LocalTrainer(make_spec(small_model_dir, beta=0.1, lr=2e-2), "cpu")
    a.take_reference()
    a.train_step(rs)
    assert a.state_dict()["reference"]["kind"] == "copy"
    path = checkpoint.save(tmp_path, 1, {"step": 1, "trainer": a.state_dict()})  # on disk: safetensors + JSON
    state = checkpoint.load(path)["trainer"]
    b = LocalTrainer(make_spec(small_model_dir, beta=0.1, lr=2e-2), "cpu")
    b.load_state_dict(state)
    for (k, x), y in zip(a.reference.parts.model.state_dict().items(),
                         b.reference.parts.model.state_dict().values()):
        assert torch.equal(x, y), k
    ma, mb = a.train_step(rs), b.train_step(rs)
    assert ma["kl_mean"] == mb["kl_mean"] and ma["loss"] == mb["loss"]


def test_a_lora_reference_is_the_base_with_the_adapter_disabled(small_model_dir):
    pytest.importorskip("peft")
    rs = rows(2)
    trainer = LocalTrainer(make_spec(small_model_dir, beta=0.1, lora=True, lr=5e-2), "cpu")
    base = _full_vocab_logprobs(trainer.model.get_base_model(), rs, 1.0)  # LoRA's B = 0: still the base
    trainer.take_reference()
    assert trainer.reference.is_base and trainer.reference.parts is trainer.parts  # no second copy
    trainer.train_step(rs)
    trainer.train_step(rs)
    ref = trainer.reference.logprobs(trainer.spec, rs, 1.0, trainer.device)
    for got, want in zip(_at_targets(ref, rs), _at_targets(base, rs)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    policy = trainer.logprobs(rs)
    assert max(abs(a - b) for p, q in zip(_at_targets(policy, rs), _at_targets(ref, rs))
               for a, b in zip(p, q)) > 1e-4  # the adapter is back on for the policy
    assert trainer.state_dict()["reference"] == {"kind": "lora_base"}


@pytest.mark.parametrize("lora", [False, True])
def test_the_reference_forward_through_the_trie_equals_the_per_row_one(small_model_dir, lora):
    from dataclasses import replace

    from fixtures.tree_rows import group_rows

    rs = group_rows(members=4)
    spec = make_spec(small_model_dir, beta=0.1, lr=2e-2, tree_packing="on",
                     **({"lora": True, "lora_r": 4} if lora else {}))
    trainer = LocalTrainer(spec, "cpu")
    trainer.take_reference()
    trainer.train_step(rs)  # the policy moves; the reference's log-probs are the frozen weights'
    assert trainer.reference.packed_batches == 1  # the step's KL targets came through the trie
    packed = trainer.reference.logprobs(trainer.spec, rs, 1.0, trainer.device)
    assert trainer.reference.packed_batches == 1
    rows_only = trainer.reference.logprobs(replace(trainer.spec, tree_packing="off"), rs, 1.0, trainer.device)
    assert trainer.reference.packed_batches == 0
    for got, want in zip(packed, rows_only):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    assert sum(v != 0.0 for lp in packed for v in lp) == sum(sum(kl_targets(r)) for r in rs)
    # a trainer that cannot pack (its kernels, its sharding) forwards the rows
    trainer.reference.logprobs(trainer.spec, rs, 1.0, trainer.device, blocker="no trie here")
    assert trainer.reference.packed_batches == 0
