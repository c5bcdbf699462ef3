"""trainers/base.py: what every trainer does around the step: export (LoRA merged), state round trips,
optimizer resets."""
import pytest
import torch
from fixtures.small_model import V, make_spec, rows

from benchmarks.smoke import sparse_row
from trainers.local import LocalTrainer


def test_lora_export_merges_and_state_round_trips(small_model_dir):
    from transformers import AutoModelForCausalLM

    b = LocalTrainer(make_spec(small_model_dir, lora=True, lora_r=4, lr=1e-2), "cpu")
    assert b.is_lora and all("lora_" in n for n, p in b.model.named_parameters() if p.requires_grad)
    b.train_step(rows(2))
    state = b.state_dict()
    plain = AutoModelForCausalLM.from_pretrained(small_model_dir)
    plain.load_state_dict(b.export_weights())
    ids = torch.tensor([rows(1)[0].input_ids[:50]])
    b.model.eval()
    with torch.no_grad():
        assert torch.allclose(plain(ids).logits, b.model(ids).logits, atol=1e-5)
        assert not torch.allclose(AutoModelForCausalLM.from_pretrained(small_model_dir)(ids).logits,
                                  b.model(ids).logits, atol=1e-4)  # the adapter did train
    b2 = LocalTrainer(make_spec(small_model_dir, lora=True, lora_r=4, lr=1e-2), "cpu")
    b2.load_state_dict(state)
    assert b2.logprobs(rows(1))[0] == pytest.approx(b.logprobs(rows(1))[0], abs=1e-6)
    m1, m2 = b.train_step(rows(2)), b2.train_step(rows(2))  # optimizer state resumed too
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-6)


def test_full_finetune_state_round_trip(small_model_dir):
    b = LocalTrainer(make_spec(small_model_dir), "cpu")
    b.train_step(rows(2))
    b2 = LocalTrainer(make_spec(small_model_dir), "cpu")
    b2.load_state_dict(b.state_dict())
    m1, m2 = b.train_step(rows(2)), b2.train_step(rows(2))
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-6)
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=1e-5)


def test_reset_optimizer_makes_the_next_step_the_step_of_a_fresh_optimizer(small_model_dir):
    warm = LocalTrainer(make_spec(small_model_dir), "cpu")
    demo = [sparse_row(i, 0.0, vocab=V, context=60) for i in range(2)]
    warm.train_step(demo, sft=True)  # the warm start leaves AdamW moments behind
    fresh, kept = LocalTrainer(make_spec(small_model_dir), "cpu"), LocalTrainer(make_spec(small_model_dir),
                                                                                "cpu")
    fresh.model.load_state_dict(warm.model.state_dict())  # the weights only: an optimizer that never stepped
    kept.load_state_dict(warm.state_dict())  # the weights and the warm start's moments
    warm.reset_optimizer()
    rl = rows(2)
    for t in (warm, fresh, kept):
        t.train_step(rl)
    after = [dict(t.model.named_parameters()) for t in (warm, fresh, kept)]
    assert all(torch.equal(p, after[1][n]) for n, p in after[0].items())
    assert any(not torch.equal(p, after[2][n]) for n, p in after[0].items())  # the moments did matter


def test_reset_momentum_zeroes_the_first_moment_and_keeps_the_second(small_model_dir):
    t = LocalTrainer(make_spec(small_model_dir), "cpu")
    t.train_step([sparse_row(i, 0.0, vocab=V, context=60) for i in range(2)], sft=True)
    before = {id(p): (s["exp_avg_sq"].clone(), int(s["step"])) for p, s in t.optimizer.state.items()}
    t.reset_optimizer(momentum_only=True)
    assert before and all(not s["exp_avg"].any() for s in t.optimizer.state.values())
    assert all(torch.equal(s["exp_avg_sq"], before[id(p)][0]) and int(s["step"]) == before[id(p)][1]
               for p, s in t.optimizer.state.items())
