"""Transformers sampler: a batched, seeded forward loop over a KV cache.

Why not `model.generate`: its `output_scores` keeps [steps, batch, vocab] floats alive (GBs at a
151k vocabulary), and we need exactly the log-prob of each sampled token under the processed
distribution. This loop keeps one [batch, vocab] row per step.
"""
from __future__ import annotations

import torch

from quaero.config import SamplerConfig
from quaero.sampling import Completion, completion_budget, finish_reason


def processed_logprobs(logits: torch.Tensor, temperature: float, top_p: float, greedy: bool) -> torch.Tensor:
    """[B, V] logits -> [B, V] log-probs of the distribution sampled from (top-p renormalised, -inf outside).

    Greedy reports the untempered log-softmax, as vLLM does at temperature 0."""
    lp = torch.log_softmax(logits.float() / (1.0 if greedy else temperature), dim=-1)
    if greedy or top_p >= 1.0:
        return lp
    sorted_lp, order = lp.sort(dim=-1, descending=True)
    cum = sorted_lp.exp().cumsum(dim=-1)
    drop_sorted = (cum - sorted_lp.exp()) >= top_p  # keep the smallest set reaching top_p (>= 1 token)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(lp.masked_fill(drop, float("-inf")), dim=-1)


class HFSampler:
    def __init__(self, model, cfg: SamplerConfig, *, stop_token_ids: list[int],
                 pad_token_id: int | None = None,
                 shares_model: bool = False, max_seq_len: int | None = None):
        self.model = model
        self.shares_model = shares_model  # the trainer's own module: weight sync is a no-op
        self.weight_transfer = "copy"  # else update_weights copies into its own module
        self.cfg = cfg
        # prompt + completion never exceed it; unset: the positions the model was built for
        self.max_seq_len = max_seq_len or model.config.max_position_embeddings
        self.stop_token_ids = list(stop_token_ids)
        self.pad_token_id = pad_token_id if pad_token_id is not None else self.stop_token_ids[-1]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompts: list[list[int]], *, n: int = 1, greedy: bool = False,
                 seed: int | None = None) -> list[list[Completion]]:
        if not prompts:
            return []
        flat = [p for p in prompts for _ in range(n)]
        budgets = [completion_budget(len(p), self.cfg.max_tokens, self.max_seq_len) for p in flat]
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed if seed is not None else torch.seed())
        was_training = self.model.training
        self.model.eval()  # no dropout; gradient checkpointing would also switch the KV cache off
        try:
            tokens, logprobs = self._sample(flat, budgets, greedy, gen)
        finally:
            self.model.train(was_training)
        out = [Completion(t, lp, finish_reason(t, self.stop_token_ids)) for t, lp in zip(tokens, logprobs)]
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], budgets: list[int], greedy: bool, gen: torch.Generator):
        dev, B = self.device, len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((B, width), self.pad_token_id, dtype=torch.long, device=dev)
        attn = torch.zeros((B, width), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):  # left padding: every row's next token sits at the same column
            ids[i, width - len(p):] = torch.tensor(p, device=dev)
            attn[i, width - len(p):] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                         logits_to_keep=1)
        stop = torch.tensor(self.stop_token_ids, device=dev)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        budget = torch.tensor(budgets, device=dev)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logprobs: list[list[float]] = [[] for _ in range(B)]
        for step in range(max(budgets)):
            lp = processed_logprobs(out.logits[:, -1], self.cfg.temperature, self.cfg.top_p, greedy)
            if greedy:
                tok = lp.argmax(-1)
            else:
                tok = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(-1)
            tok_lp = lp.gather(-1, tok[:, None]).squeeze(-1)
            for i in (~done).nonzero().flatten().tolist():
                tokens[i].append(int(tok[i]))
                logprobs[i].append(float(tok_lp[i]))
            done |= torch.isin(tok, stop) | (budget <= step + 1)
            if bool(done.all()):
                break
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=dev)], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=pos,
                             past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        return tokens, logprobs

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """A no-op when the sampler shares the trainer's module; otherwise copy the tensors in."""
        own = self.model.state_dict()
        if all(k in own and own[k].data_ptr() == v.data_ptr() for k, v in state_dict.items()):
            return
        missing = [k for k in state_dict if k not in own]
        if missing:
            raise KeyError(f"HFSampler.update_weights: {len(missing)} unknown tensors, e.g. {missing[:3]}")
        with torch.no_grad():
            for k, v in state_dict.items():
                own[k].copy_(v.to(own[k].device, own[k].dtype))

    def close(self) -> None:
        pass


def build(cfg, *, model=None, stop_token_ids: list[int], device: str, log_dir=None) -> HFSampler:
    """The `hf` engine for `cfg` (quaero/sampler_registry.py): on the trainer's own module when given one
    (`model`: weight sync is free), else on a model of its own."""
    from quaero.models.load import load_causal_lm

    shares = model is not None
    if model is None:
        model = load_causal_lm(cfg.model.name, cfg.model.dtype, device)
    return HFSampler(model, cfg.sampler, stop_token_ids=stop_token_ids, shares_model=shares,
                     max_seq_len=cfg.model.max_seq_len)
