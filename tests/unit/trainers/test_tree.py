"""Exact tree training (trainers/tree.py): the trie, its ancestor mask, and a packed step equal to the per-row
step on the same rows (log-probs, losses, every parameter's gradient), for both model families, LoRA and full
fine-tuning, SDPA and eager attention; the fallback when the model cannot take the mask."""

import pytest
import torch
from fixtures.small_model import make_spec
from fixtures.tree_rows import group_rows

from quaero.models.load import resolve_model
from quaero.rows import EchoRow
from quaero.telemetry import proofs
from trainers import step
from trainers.local import LocalTrainer
from trainers.tree import TreePack, pack_rows


def test_the_trie_mask_is_the_ancestor_relation_and_unpacks_to_the_rows():
    rows = group_rows(5)
    ids, attn = _padded(rows)
    pack = pack_rows(ids, attn)
    assert torch.equal(pack.unpack(pack.input_ids) * attn, ids)  # every row token finds its node
    assert pack.unique_tokens == 40 + 12 + 3 * 12 + sum(4 + m + 6 for m in range(5))
    assert pack.ratio == pytest.approx(pack.unique_tokens / int(attn.sum()))
    # brute force: q sees k iff k lies on q's path, for every (row, position) pair
    want = torch.zeros(pack.unique_tokens, pack.unique_tokens, dtype=torch.bool)
    for b, r in enumerate(rows):
        path = pack.gather[b, :len(r)]
        for t in range(len(r)):
            want[path[t], path[:t + 1]] = True
            assert pack.position_ids[0, path[t]] == t
    assert torch.equal(pack.mask("sdpa", torch.float32)[0, 0], want)
    additive = pack.mask("eager", torch.float32)[0, 0]
    assert torch.equal(additive == 0, want) and bool((additive[~want] < -1e30).all())


def _step(model, rows, *, lora=False, attn=None, **kw):
    """One step's metrics, per-token log-probs before it and every parameter's gradient."""
    trainer = LocalTrainer(make_spec(model, lora=lora, lora_r=4, lora_alpha=8, **kw), "cpu")
    if attn:
        trainer.model.set_attn_implementation(attn)
    logprobs = step.audit_logprobs(trainer, rows, 1.0)
    grads = {}
    real = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return real(*args, **kwargs)

    trainer.optimizer.step = capture
    return trainer.train_step(rows), torch.tensor([x for row in logprobs for x in row]), grads


FAMILIES = [("small-qwen3", False, None, False), ("small-qwen3", False, "eager", False),
            ("small-qwen3", False, None, True), ("tiny-qwen3", True, None, False),
            ("tiny-smollm2", False, None, False), ("tiny-smollm2", True, None, False)]


@pytest.mark.parametrize(("family", "lora", "attn", "checkpointing"), FAMILIES,
                         ids=["-".join(map(str, f)) for f in FAMILIES])
def test_a_packed_step_equals_the_per_row_step(small_model_dir, family, lora, attn, checkpointing):
    model = small_model_dir if family == "small-qwen3" else family
    if model == family:  # built first: a build draws from the RNG the trainer seeds before its LoRA init
        resolve_model(family)
    rows = group_rows(4)
    kw = {"lora": lora, "attn": attn, "gradient_checkpointing": checkpointing}
    ref, ref_lp, ref_grads = _step(model, rows, **kw)
    got, got_lp, got_grads = _step(model, rows, **kw, tree_packing="on")
    assert got["local_train_tree_batches"] == got["microbatches"] == 1
    assert got["local_train_tree_fallback_batches"] == 0 and got["local_train_tree_fallback_reason"] == ""
    assert got["local_train_tree_token_ratio"] < 0.7 and ref["local_train_tree_token_ratio"] is None
    assert got["forward_passes_per_microbatch"] == 1
    _assert_same_step(got, ref, got_lp, ref_lp, got_grads, ref_grads)


def test_a_model_that_ignores_the_mask_falls_back_with_its_reason(small_model_dir, monkeypatch):
    """Fault injection: a mask that lets every token see every other (an attention that ignores the 4D mask)
    fails the probe; the step trains the rows, exactly the per-row step, and counts why."""
    rows = group_rows(3)
    ref, _, ref_grads = _step(small_model_dir, rows)
    monkeypatch.setattr(TreePack, "mask", lambda self, impl, dtype: torch.ones(
        1, 1, self.unique_tokens, self.unique_tokens, dtype=torch.bool))
    got, _, got_grads = _step(small_model_dir, rows, tree_packing="on")
    assert got["local_train_tree_batches"] == 0 and got["local_train_tree_fallback_batches"] == 1
    assert "differs from the per-row one" in got["local_train_tree_fallback_reason"]
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert all(torch.allclose(got_grads[n], g, atol=1e-6, rtol=1e-5) for n, g in ref_grads.items())
    check = proofs.tree_training({k: got[k] for k in (*proofs.TREE_COUNTERS, "local_train_tree_packing",
                                                      "local_train_tree_fallback_reason")})
    assert check.status == "fail" and "differs" in check.detail


def test_an_attention_without_a_custom_mask_falls_back(small_model_dir):
    trainer = LocalTrainer(make_spec(small_model_dir, tree_packing="on"), "cpu")
    trainer.parts.config._attn_implementation = "flash_attention_2"  # what tree_support reads; never run here
    mb = step.build_microbatches(group_rows(2), micro_batch_tokens=10**6, weights={})[0][0]
    tree, info = step.choose_tree("on", trainer.parts, mb.input_ids, mb.attention_mask)
    assert tree is None and not info.packed and "flash_attention_2" in info.fallback_reason


def test_auto_packs_only_where_the_ratio_pays(small_model_dir):
    shared = group_rows(4)
    unshared = [group_rows(1, seed=s)[0] for s in range(4)]  # no common prefix
    m_shared, _, _ = _step(small_model_dir, shared, tree_packing="auto")
    m_unshared, _, _ = _step(small_model_dir, unshared, tree_packing="auto")
    assert m_shared["local_train_tree_batches"] == 1
    assert m_unshared["local_train_tree_batches"] == m_unshared["local_train_tree_fallback_batches"] == 0
    assert m_unshared["local_train_tree_token_ratio"] > 0.95
    check = proofs.tree_training({**{k: m_shared[k] for k in proofs.TREE_COUNTERS},
                                  "local_train_tree_packing": "auto"})
    assert check.status == "pass"


def test_rows_sharing_a_prefix_share_a_microbatch_and_the_step_stays_exact(small_model_dir):
    """Two groups interleaved, a budget of three rows: packing orders rows by prefix, so each microbatch is
    one group's trie; the step still equals the per-row step (whose microbatches mix the groups)."""
    a, b = group_rows(3, seed=1), group_rows(3, seed=2)
    rows = [r for pair in zip(a, b) for r in pair]
    budget = 3 * max(len(r) for r in rows)
    ref, ref_lp, ref_grads = _step(small_model_dir, rows, micro_batch_tokens=budget)
    got, got_lp, got_grads = _step(small_model_dir, rows, micro_batch_tokens=budget, tree_packing="on")
    assert got["microbatches"] == got["local_train_tree_batches"] == 2
    tries = [pack_rows(*_padded(group)).unique_tokens for group in (a, b)]
    assert got["local_train_tree_unique_tokens"] == sum(tries)
    assert torch.allclose(got_lp, ref_lp, atol=1e-5, rtol=0)
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    for name, g in ref_grads.items():
        assert torch.allclose(got_grads[name], g, atol=1e-5, rtol=1e-4), name


def _padded(rows: list[EchoRow]) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r.input_ids)
        attn[i, :len(r)] = 1
    return ids, attn


def test_auto_weighs_the_tries_attention_against_the_rows():
    """SmolLM2-135M's sizes: a group of 8 sharing 370 of ~450 tokens pays; 8 unrelated rows never do (their
    trie attends over all 8 x 450 tokens); a config without sizes falls back to the token ratio."""
    from types import SimpleNamespace

    from trainers.tree import tree_pays

    smol = SimpleNamespace(hidden_size=576, num_attention_heads=9, head_dim=64, num_key_value_heads=3,
                           intermediate_size=1536)
    shared = pack_rows(*_padded(group_rows(8, prompt=370)))
    unshared = pack_rows(*_padded([group_rows(1, prompt=370, seed=s)[0] for s in range(8)]))
    shape = tuple(_padded(group_rows(8, prompt=370))[0].shape)
    assert tree_pays(shared, smol, shape) and not tree_pays(unshared, smol, shape)
    assert tree_pays(shared, None, shape) and not tree_pays(unshared, None, shape)


SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "head_dim": 64,
           "num_key_value_heads": 3, "intermediate_size": 1536}


def _smol_rows(prefixes: list[tuple[int, int]], members: int, tail: int, seed: int = 0) -> list[list[int]]:
    """Per group, `members` rows: the group's prefix (the first `shared` tokens common to every group, then
    the group's own, to `length` tokens), then `tail` tokens of each member's own (lengths differ by member).
    """
    import random

    rng = random.Random(seed)
    common = [rng.randrange(49152) for _ in range(max(s for s, _ in prefixes))]
    out = []
    for shared, length in prefixes:
        prompt = common[:shared] + [rng.randrange(49152) for _ in range(length - shared)]
        out += [prompt + [rng.randrange(49152) for _ in range(tail + m)] for m in range(members)]
    return out


def test_the_planner_puts_a_group_of_8_with_a_long_prompt_in_one_microbatch():
    """SmolLM2-135M's sizes, the learning curve's shape: 8 rows sharing a 700-token prompt, ~1,100 tokens
    each. Padded, a 4,096-token budget holds 3 of them (the prompt forwarded in 3 microbatches); costed as the
    trie the packed forward runs (unique tokens, the gathered hidden states, the mask), the group is one."""
    from types import SimpleNamespace

    from trainers.batch import plan_microbatches, plan_tree_microbatches
    from trainers.tree import packed_cost

    smol = SimpleNamespace(**SMOLLM2)
    ids = _smol_rows([(0, 700)], members=8, tail=390)
    assert [len(g) for g in plan_microbatches([len(r) for r in ids], 4096)] == [3, 3, 2]
    plan = plan_tree_microbatches(ids, 4096, lambda u, t, b, n: packed_cost(u, (b, n), smol))
    assert [sorted(g) for g in plan] == [list(range(8))]
    unique = pack_rows(*_padded_ids(ids)).unique_tokens
    assert unique == 700 + sum(390 + m for m in range(8))
    assert unique < packed_cost(unique, (8, max(map(len, ids))), smol) <= 4096 < 8 * max(map(len, ids))


def test_the_planner_cuts_between_groups_not_inside_one():
    """Two groups sharing a 300-token system prompt, each its own 400-token task, 8 members of 100 tokens: a
    budget that holds a group and a half gets one microbatch per group (cutting inside the second group would
    forward its task twice); greedy filling alone would have cut inside it."""
    from trainers.batch import plan_tree_microbatches

    ids = _smol_rows([(300, 700), (300, 700)], members=8, tail=100)
    cost = []

    def unique_only(unique, row_tokens, rows, longest):
        cost.append(unique)
        return unique

    plan = plan_tree_microbatches(ids, 2300, unique_only)
    assert sorted(sorted(g) for g in plan) == [list(range(8)), list(range(8, 16))]
    assert max(cost) > 2000  # the first group and part of the second fitted the budget together


def test_auto_plans_rows_that_do_not_pay_on_their_padded_tokens(small_model_dir):
    """Four unrelated rows under "auto" with a budget of two padded rows: the trie would not pay, so the
    planner keeps the padded budget (two microbatches of two rows), and nothing packs."""
    unshared = [group_rows(1, seed=s)[0] for s in range(4)]
    budget = 2 * max(len(r) for r in unshared)
    got, _, _ = _step(small_model_dir, unshared, tree_packing="auto", micro_batch_tokens=budget)
    assert got["microbatches"] == 2 and got["padded_tokens"] <= 2 * budget
    assert got["local_train_tree_batches"] == got["local_train_tree_fallback_batches"] == 0


@pytest.mark.parametrize("mode", ["on", "auto"])
def test_a_group_that_padded_rows_split_is_one_packed_microbatch_and_exact(small_model_dir, mode):
    """A group of 8 multi-turn rows (ECHO on) sharing a 120-token prompt, a budget of 4 padded rows: per row
    the step takes 2 microbatches, packed (planned on the trie's unique tokens) 1; per-token log-probs, the
    loss and every parameter's gradient equal within 1e-5 (float32)."""
    rows = group_rows(8, prompt=120)
    budget = 4 * max(len(r) for r in rows)
    ref, ref_lp, ref_grads = _step(small_model_dir, rows, micro_batch_tokens=budget)
    got, got_lp, got_grads = _step(small_model_dir, rows, micro_batch_tokens=budget, tree_packing=mode)
    assert ref["microbatches"] == 2 and got["microbatches"] == got["local_train_tree_batches"] == 1
    assert got["local_train_tree_unique_tokens"] == pack_rows(*_padded(rows)).unique_tokens
    assert got["local_train_tree_token_ratio"] < 0.5
    _assert_same_step(got, ref, got_lp, ref_lp, got_grads, ref_grads)


def _padded_ids(ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return _padded([EchoRow(r, [], [0.0] * len(r), [0.0] * len(r), [0.0] * len(r)) for r in ids])


def _assert_same_step(got, ref, got_lp, ref_lp, got_grads, ref_grads):
    """The tree step's per-token log-probs, loss terms and every gradient equal the rows' (float32, 1e-5)."""
    assert torch.allclose(got_lp, ref_lp, atol=1e-5, rtol=0) and bool((ref_lp != 0).any())
    for key in ("loss", "rl_loss", "echo_loss", "grad_norm", "action_tokens", "echo_tokens"):
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), key
    assert got_grads.keys() == ref_grads.keys() and len(ref_grads) > 0
    for name, g in ref_grads.items():
        assert torch.allclose(got_grads[name], g, atol=1e-5, rtol=1e-4), name
