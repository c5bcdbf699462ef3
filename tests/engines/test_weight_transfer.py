"""Server mode's push through vLLM's weight-transfer engines (`[sampler] weight_transfer = "ipc" | "nccl"`),
on CUDA only (run by scripts/gpu_check.sh): after a push the server's log-probs are the trained model's, and a
push back restores them, as test_sampling.py checks for the file push. IPC: a server on the trainer's GPU;
NCCL: a server on a GPU of its own (`server_devices = [1]`, two GPUs or more)."""
import copy

import pytest
import torch

from quaero.config import SamplerConfig

# gpu only, not vllm: CI's engine tier (QUAERO_REQUIRE_ENGINES=1) fails vllm-marked tests that skip, and these
# skip on every machine without CUDA
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run "
                                                                       "scripts/gpu_check.sh)")]

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
STOP = [151645, 151643]


def _gap(model, comp, temperature=1.0) -> float:
    """Largest gap between the sampler's log-probs and the trainer model's at the sampled tokens."""
    ids = torch.tensor([PROMPT + comp.token_ids], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1:-1].float() / temperature
    ref = logits.log_softmax(-1).gather(-1, ids[0, len(PROMPT):, None]).squeeze(-1)
    return (torch.tensor(comp.logprobs, device="cuda") - ref).abs().max().item()


@pytest.mark.parametrize("backend, devices", [
    ("ipc", []),
    pytest.param("nccl", [1], marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")),
])
def test_a_push_through_vllms_weight_transfer_reaches_the_server(tiny_model_dir, backend, devices):
    from fixtures import require_vllm

    require_vllm()
    from quaero.models.load import load_causal_lm
    from quaero.sampling.server import VLLMServerSampler, start_vllm_servers

    model = load_causal_lm("tiny-qwen3", "float32", "cuda").eval()
    sc = SamplerConfig(mode="server", weight_transfer=backend, server_devices=devices, temperature=1.0,
                       max_tokens=12, gpu_memory_utilization=0.2)
    procs = start_vllm_servers(str(tiny_model_dir), sc, count=1, dtype="float32", max_model_len=4096,
                               max_num_seqs=16)
    sampler = VLLMServerSampler([p.url for p in procs], sc, stop_token_ids=STOP, processes=procs)
    try:
        trained = copy.deepcopy(model)
        with torch.no_grad():
            for p in [*trained.model.layers[0].parameters(), trained.model.embed_tokens.weight]:
                p.add_(0.05 * torch.randn_like(p))
        sampler.update_weights(trained.state_dict())
        pushed = sampler.generate([PROMPT], seed=2)[0][0]
        assert _gap(trained, pushed) < 1e-4 and _gap(model, pushed) > 1e-3
        sampler.update_weights(model.state_dict())  # the engines connect once and send again
        back = sampler.generate([PROMPT], seed=2)[0][0]
        assert _gap(model, back) < 1e-4
        assert sampler.weight_transfer == backend and len(sampler.transfer.engines) == 1
    finally:
        sampler.close()
