"""trainers/compiled_ce.py: where the compiled selected CE may run, and its answer where it may not."""
import pytest
import torch
from torch import nn

from trainers.chunked_ce import LogitTransform
from trainers.compiled_ce import compile_unavailable_reason, compiled_selected_logprobs

CUDA = torch.device("cuda")


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 6)

    def forward(self, h):
        return self.inner(h)


def test_each_reason_it_cannot_run_is_named_first_things_first():
    head = nn.Linear(4, 6)
    assert compile_unavailable_reason(CUDA, head, 3, 8) == "below_min_tokens"
    assert compile_unavailable_reason(torch.device("cpu"), head, 8, 8) == "non_cuda"
    assert compile_unavailable_reason(CUDA, Wrapped(), 8, 8) == "lm_head_not_plain_linear"
    assert compile_unavailable_reason(CUDA, head, 8, 8) == ""


def test_on_cpu_it_returns_no_logprobs_and_the_reason():
    h, targets = torch.zeros(8, 4), torch.zeros(8, dtype=torch.long)
    lp, reason = compiled_selected_logprobs(h, nn.Linear(4, 6), targets, 1.0, LogitTransform(), 1)
    assert lp is None and reason == "non_cuda"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled CE runs on CUDA only")
def test_on_cuda_it_equals_log_softmax():
    head = nn.Linear(4, 6).cuda()
    h, y = torch.randn(8, 4, device="cuda"), torch.randint(0, 6, (8,), device="cuda")
    lp, reason = compiled_selected_logprobs(h, head, y, 0.7, LogitTransform(softcap=3.0), 1)
    logits = LogitTransform(softcap=3.0).apply(head(h).float()) / 0.7
    ref = torch.log_softmax(logits, -1).gather(1, y[:, None])
    assert reason == "" and torch.allclose(lp, ref.squeeze(1), atol=1e-5)
