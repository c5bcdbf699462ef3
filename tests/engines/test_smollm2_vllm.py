"""The second family in vLLM's CPU build: tiny-smollm2 (Llama, tied head, SmolLM2's tokenizer) loads, samples
a chat prompt its template renders, and its log-probs equal the trainer model's (transformers)."""
import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.smollm2, pytest.mark.slow]


def test_vllm_samples_tiny_smollm2_with_the_trainers_log_probs(tiny_smollm2_dir):
    from fixtures import require_vllm

    require_vllm()
    from quaero.config import SamplerConfig
    from quaero.models.load import load_causal_lm, load_tokenizer
    from quaero.sampling.vllm import VLLMSampler, make_engine

    tok = load_tokenizer("tiny-smollm2")
    model = load_causal_lm("tiny-smollm2").eval()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Price of SKU A-12?"}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    llm = make_engine(str(tiny_smollm2_dir), dtype="float32", max_model_len=2048, max_num_seqs=4,
                      in_process=False)
    try:
        sampler = VLLMSampler(str(tiny_smollm2_dir), SamplerConfig(temperature=0.7, max_tokens=12),
                              stop_token_ids=[tok.eos_token_id], max_model_len=2048, llm=llm)
        (c,) = sampler.generate([prompt], seed=3)[0]
        assert 1 <= len(c.token_ids) <= 12 and len(c.logprobs) == len(c.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1] / 0.7
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
        assert (torch.tensor(c.logprobs) - ref).abs().max() < 1e-3
    finally:
        del llm
