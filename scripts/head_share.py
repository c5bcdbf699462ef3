"""The LM head's share of a train step on a named model: one row's forward + backward with the head over every
position (full logits), over the loss targets only (quaero's selective path), and without the head (the
backbone alone), side by side, interleaved, on one thread.

    python scripts/head_share.py --model gemma3-270m --seq-len 1024 --targets 128 --repeats 3

Weights frozen but for each layer's attention output projection (a LoRA-like step: the backward reaches every
layer's input, no AdamW over the embedding), float32, CPU. Prints the median seconds of each path, the head's
share of the selective step ((selective - backbone) / selective) and of the full-logits step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--targets", type=int, default=128, help="loss tokens, at the row's end")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from quaero.models.load import resolve_model

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32)
    for name, param in model.named_parameters():
        param.requires_grad_(name.endswith("self_attn.o_proj.weight"))
    vocab = model.config.vocab_size
    ids = torch.randint(1000, vocab - 1000, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    at = torch.arange(args.seq_len - args.targets - 1, args.seq_len - 1)
    head = model.get_output_embeddings()

    def step(path: str) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        hidden = model.model(input_ids=ids).last_hidden_state[0]
        if path == "backbone":
            loss = hidden[at].float().pow(2).mean()
        elif path == "selective":
            loss = F.cross_entropy(head(hidden[at]).float(), ids[0, at + 1])
        else:
            loss = F.cross_entropy(head(hidden).float()[at], ids[0, at + 1])
        loss.backward()
        return time.perf_counter() - start

    paths = ("full", "selective", "backbone")
    for path in paths:
        step(path)  # warm-up
    times: dict[str, list[float]] = {path: [] for path in paths}
    for _ in range(args.repeats):
        for path in paths:
            times[path].append(step(path))
    med = {path: statistics.median(ts) for path, ts in times.items()}
    print(f"{args.model}: vocabulary {vocab:,}, hidden {model.config.hidden_size}, "
          f"row {args.seq_len} tokens, {args.targets} targets, {args.threads} thread(s), "
          f"median of {args.repeats}")
    for path in paths:
        print(f"  {path:<10} {med[path]:7.2f} s  ({', '.join(f'{t:.2f}' for t in times[path])})")
    for path in ("selective", "full"):
        print(f"  the head's share of the {path} step: {(med[path] - med['backbone']) / med[path]:.1%}")
    print(f"  selective vs full logits: {med['full'] / med['selective']:.2f}x")


if __name__ == "__main__":
    main()
