"""The in-process transformers sampler (quaero/sampling/hf.py): the log-probs of the distribution sampled
from, and never more tokens than the context has left."""
from __future__ import annotations

import pytest
import torch
from fixtures.rollout import IM_END

from quaero.config import SamplerConfig
from quaero.sampling.hf import HFSampler, processed_logprobs


def test_processed_logprobs_renormalise_over_the_top_p_set_and_greedy_is_untempered():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    full = processed_logprobs(logits, 1.0, 1.0, False)
    assert torch.allclose(full.exp(), torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = processed_logprobs(logits, 1.0, 0.8, False).exp()  # 0.5 + 0.3 reach 0.8: the rest is dropped
    assert torch.allclose(kept, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    hot = processed_logprobs(logits, 2.0, 1.0, False)
    assert torch.allclose(hot, torch.log_softmax(logits / 2.0, -1))
    assert torch.allclose(processed_logprobs(logits, 2.0, 0.1, True), full)  # greedy: T and top-p unused


@pytest.mark.hostile
def test_hf_sampler_never_returns_more_tokens_than_the_context_left(tiny_lm):
    prompts = [[151644, 872, 198] + [9707] * 40, [151644, 872, 198] + [9707] * 43]  # 43 and 46 tokens
    sampler = HFSampler(tiny_lm, SamplerConfig(max_tokens=64), stop_token_ids=[IM_END], max_seq_len=49)
    out = sampler.generate(prompts, n=2, seed=0)
    for prompt, comps in zip(prompts, out):
        for c in comps:
            assert len(prompt) + len(c.token_ids) <= 49 and len(c.logprobs) == len(c.token_ids)
            if c.token_ids[-1] != IM_END:
                assert len(c.token_ids) == 49 - len(prompt) and c.finish_reason == "length"
    with pytest.raises(ValueError, match="leaves no room under \\[model\\] max_seq_len=49"):
        sampler.generate([[9707] * 49])
