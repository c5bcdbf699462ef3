"""trainers/chunked_ce.py: the logit transform, and the chunked selected log-probs against log_softmax."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from trainers.chunked_ce import (
    ChunkedSelectedLogprobs,
    LogitTransform,
    checkpointed_selected_logprobs,
    tempered,
)


def test_a_transform_scales_then_softcaps_and_knows_its_derivative():
    x = torch.tensor([-4.0, 0.0, 2.0])
    assert LogitTransform().identity and torch.equal(LogitTransform().apply(x), x)
    cap = LogitTransform(scale=0.5, softcap=3.0)
    assert torch.allclose(cap.apply(x), 3.0 * torch.tanh(0.5 * x / 3.0))
    raw = x.clone().requires_grad_(True)
    cap.apply(raw).sum().backward()
    assert torch.allclose(cap.derivative(x), raw.grad) and LogitTransform(scale=2.0).derivative(x) == 2.0
    assert tempered(x, 1.0) is x and torch.equal(tempered(x, 2.0), x / 2.0)


def _reference(h, head, y, T, transform):  # [S]
    return F.log_softmax(transform.apply(head(h).float()) / T, dim=-1).gather(1, y[:, None]).squeeze(1)


@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=0.5, softcap=3.0)])
def test_both_chunked_paths_equal_log_softmax_in_value_and_gradient(transform):
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(8, 37)
    h, y = torch.randn(11, 8, generator=g), torch.randint(0, 37, (11,), generator=g)
    w = torch.randn(11, generator=g)

    def run(fn):
        hh = h.clone().requires_grad_(True)
        head.zero_grad()
        lp = fn(hh)
        (lp * w).sum().backward()
        return lp.detach(), hh.grad, head.weight.grad.clone(), head.bias.grad.clone()

    ref = run(lambda hh: _reference(hh, head, y, 0.7, transform))
    for fn in (lambda hh: ChunkedSelectedLogprobs.apply(hh, head.weight, head.bias, y, 4, 0.7, transform),
               lambda hh: checkpointed_selected_logprobs(hh, head, y, 4, 0.7, transform)):
        for got, want in zip(run(fn), ref):
            assert torch.allclose(got, want, atol=1e-5)


def test_a_chunk_below_1_is_refused_with_its_option():
    with pytest.raises(ValueError, match="train_logprob_chunk_size=0"):
        checkpointed_selected_logprobs(torch.zeros(2, 4), nn.Linear(4, 5), torch.zeros(2, dtype=torch.long),
                                       0, 1.0, LogitTransform())
