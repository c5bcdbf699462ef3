"""What the transformers sampler reuses (quaero/sampling/kv_reuse.py): the inverse-CDF draw samples the same
distribution as torch.multinomial; KV shared by a group's members and carried across turns gives the tokens
and log-probs a sampler that prefills everything gives; new weights drop the cache."""
from __future__ import annotations

import copy

import pytest
import torch

from quaero.config import SamplerConfig
from quaero.sampling.hf import HFSampler, processed_logprobs
from quaero.sampling.kv_reuse import BLOCK, PrefixKV, draw, reusable
from quaero.telemetry import names

HEAD = [17, 872, 198]  # ids under both families' vocabularies
STOP = 2


def test_the_draw_samples_each_token_in_proportion_and_never_a_zero_one():
    V = 3 * BLOCK + 17  # a partial last block
    p = torch.zeros(V)
    picks = {5: 0.1, BLOCK - 1: 0.15, BLOCK: 0.05, 2 * BLOCK + 3: 0.3, V - 1: 0.4}
    for i, q in picks.items():
        p[i] = q
    n = 20_000
    ids = draw(p.expand(n, V), torch.Generator().manual_seed(0))
    assert set(ids.tolist()) <= set(picks)
    for i, q in picks.items():
        share = float((ids == i).float().mean())
        assert abs(share - q) < 4 * (q * (1 - q) / n) ** 0.5, (i, share, q)
    again = draw(p.expand(n, V), torch.Generator().manual_seed(0))
    assert torch.equal(ids, again)  # seeded: reproducible


@pytest.mark.parametrize("bad", ["nan", "inf", "no mass"])
def test_the_draw_refuses_a_row_that_multinomial_refuses(bad):
    """torch.multinomial raises on nan, inf or an all-zero row (a diverged model's logits); the draw did
    return token 0 with a nan log-prob."""
    p = torch.full((2, 2 * BLOCK + 5), 1.0 / (2 * BLOCK + 5))
    p[1] = {"nan": float("nan"), "inf": float("inf"), "no mass": 0.0}[bad]
    with pytest.raises(ValueError, match="nan, inf or a row of no mass"):
        draw(p, torch.Generator().manual_seed(0))


def test_the_draw_matches_multinomial_on_a_top_p_distribution_of_a_real_vocabulary():
    logits = torch.randn(1, 151_936, generator=torch.Generator().manual_seed(1)) * 4
    probs = processed_logprobs(logits, 1.0, 0.9, False).exp()  # most entries exactly 0
    n = 4000
    ours = draw(probs.expand(n, -1), torch.Generator().manual_seed(2))
    theirs = torch.multinomial(probs, n, replacement=True, generator=torch.Generator().manual_seed(3))[0]
    assert bool((probs[0, ours] > 0).all())
    top = probs[0].topk(5).indices  # the most likely tokens: the same frequency within sampling noise
    for t in top.tolist():
        a, b, q = float((ours == t).float().mean()), float((theirs == t).float().mean()), float(probs[0, t])
        assert abs(a - q) < 5 * (q / n) ** 0.5 + 1e-3 and abs(b - q) < 5 * (q / n) ** 0.5 + 1e-3


def _pair(model, **cfg):
    settings = SamplerConfig(**{"max_tokens": 6, "temperature": 1.0, **cfg})
    plain = HFSampler(model, settings, stop_token_ids=[STOP], kv_cache_bytes=0)
    reusing = HFSampler(model, settings, stop_token_ids=[STOP])
    assert reusing.prefix is not None and plain.prefix is None
    return plain, reusing


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        for c, d in zip(x, y, strict=True):
            assert c.token_ids == d.token_ids
            assert max(abs(u - v) for u, v in zip(c.logprobs, d.logprobs)) < 1e-5


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-smollm2"])
def lm(request, tiny_lm):
    if request.param == "tiny-qwen3":
        return tiny_lm
    from fixtures import require_smollm2

    from quaero.models.load import load_causal_lm

    require_smollm2()
    return load_causal_lm("tiny-smollm2").eval()


def test_a_group_and_its_next_turn_sample_what_a_full_prefill_samples(lm):
    plain, reusing = _pair(lm)
    task_a = HEAD + list(range(1000, 1040))
    task_b = HEAD + list(range(1000, 1020)) + list(range(3000, 3012))  # shares 23 tokens with task a
    turn1 = [task_a] * 4 + [task_b] * 2  # two groups, as the driver sends them: one prompt per member
    first = reusing.generate(turn1, seed=7)
    _same(plain.generate(turn1, seed=7), first)
    counts = reusing.take_counts()
    assert counts[names.SAMPLER_PREFILL_TOKENS] == len(task_a) + len(task_b) - 23
    assert counts[names.SAMPLER_REUSED_TOKENS] == 3 * len(task_a) + len(task_b) + 23
    # the next turn: each member's prompt + completion + an env reply; one member's render broke the prefix
    turn2 = [p + c[0].token_ids + [STOP, 198, 17, 9707, 198] for p, c in zip(turn1, first)]
    turn2[-1] = task_b[:-2] + [42] * 9
    _same(plain.generate(turn2, seed=8), reusing.generate(turn2, seed=8))
    counts = reusing.take_counts()
    assert counts[names.SAMPLER_PREFIX_HITS] == 6  # the broken one still reuses its shared head
    extended = sum(len(p) for p in turn2[:-1]) - counts[names.SAMPLER_REUSED_TOKENS] + len(task_b) - 2
    assert 5 <= extended <= 5 * 6  # each extending member prefills its last completion token and the reply
    assert reusing.take_counts() == {}


def test_new_weights_drop_the_cache_copied_or_changed_in_place(tiny_lm):
    model = copy.deepcopy(tiny_lm)
    plain, reusing = _pair(model)
    prompts = [HEAD + list(range(500, 530))] * 2
    reusing.generate(prompts, seed=1)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items() if v.is_floating_point()}
    reusing.update_weights(new)  # a copy into its own module
    _same(plain.generate(prompts, seed=2), reusing.generate(prompts, seed=2))
    assert reusing.take_counts()[names.SAMPLER_PREFILL_TOKENS] == 2 * len(prompts[0])  # both calls: no reuse
    with torch.no_grad():  # the trainer's own module stepped in place: no update_weights call says so
        for p in model.parameters():
            p.mul_(1.01)
    _same(plain.generate(prompts, seed=3), reusing.generate(prompts, seed=3))
    assert reusing.take_counts()[names.SAMPLER_PREFILL_TOKENS] == len(prompts[0])


def test_the_store_keeps_within_its_bytes_and_finds_the_longest_prefix():
    def kv(n):  # 2 layers, 1 head, head_dim 4: 2 * 2 * n * 4 float32s
        return [(torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 1, n, 4).clone(),) * 2] * 2

    store = PrefixKV(max_bytes=2 * 2 * 10 * 4 * 4)  # room for 10 tokens
    store.put([1, 2, 3, 4], kv(4))
    store.put([1, 2, 3, 4, 5, 6], kv(6))  # extends the first: the first is dropped
    assert len(store) == 1
    n, got = store.longest([1, 2, 3, 9], limit=3)
    assert n == 3 and got[0][0].shape == (1, 1, 3, 4) and got[0][0][0, 0, :, 0].tolist() == [0, 1, 2]
    store.put([7, 8, 9, 10, 11], kv(5))  # 6 + 5 > 10: the least recently used goes
    assert len(store) == 1 and store.longest([1, 2], limit=2) == (0, None)
    store.put(list(range(11)), kv(11))  # larger than the whole store: not kept
    assert store.longest([7, 8, 9], 3)[0] == 3
    store.check((1,))
    assert len(store) == 0


def test_a_sliding_window_model_prefills_every_prompt_whole():
    from quaero.models.qwen3 import random_qwen3

    full = random_qwen3(64, 32, layers=2)
    sliding = random_qwen3(64, 32, layers=2, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert reusable(full) and not reusable(sliding)
    assert HFSampler(sliding, SamplerConfig(), stop_token_ids=[0]).prefix is None
