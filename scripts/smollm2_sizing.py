"""Sizing a SmolLM2 job on this machine: one `local` trainer step and the `hf` sampler's speed.

    python scripts/smollm2_sizing.py [--model smollm2-135m-instruct] [--dtypes float32,bfloat16]
        [--tokens 512,2048] [--modes full,lora] [--json PATH]

For each dtype, fine-tuning mode (full, LoRA r 16) and step size it builds the trainer `quaero train` builds
(trainers/, a TrainerSpec in code) and times two warm-start (SFT) steps on rows shaped like toolbench's oracle
demos: rows of 512 tokens (one for 512, four for 2048: the warm start's 4 demos a step), a third of each row
assistant tokens (the SFT targets) and a sixth env tokens (ECHO). The first step allocates AdamW's state,
the second is the steady one (`--steps 1`: the first only; on a loaded machine they differed by ~10%).
Then the `hf` sampler (quaero/sampling/hf.py) on the same model generates
`--gen-tokens` tokens for a batch of `--gen-batch` prompts of ~300 tokens (a group's prompts) at
temperature 0.7 and reports tokens a second. Peak RSS is the process's, reset before each step.
Figures depend on the machine's load: say what else ran.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def sft_rows(count: int, length: int, vocab: int, seed: int = 0):
    """`count` rows of `length` ids: a third assistant tokens (SFT targets) in two turns, a sixth env
    tokens."""
    from benchmarks.trainstep import row_with_targets

    rows = []
    for i in range(count):
        gen = torch.Generator().manual_seed(seed + i)
        ids = torch.randint(3, vocab, (length,), generator=gen).tolist()
        act, env = [], []
        for turn in range(2):
            start = length // 3 + turn * length // 3
            act += list(range(start, start + length // 6))
            env += list(range(start + length // 6, start + length // 6 + length // 12))
        rows.append(row_with_targets(ids, env, act))
    return rows


def time_steps(model: str, dtype: str, lora: bool, tokens: int, steps: int) -> dict:
    from trainers.memory import peak_mem_mb, reset_peak
    from trainers.registry import trainer_class
    from trainers.spec import TrainerSpec

    spec = TrainerSpec(model=model, dtype=dtype, lora=lora, max_seq_len=2048, micro_batch_tokens=8192,
                       echo_weight=0.1)
    t0 = time.perf_counter()
    trainer = trainer_class("local")(spec, "cpu")
    load_s = time.perf_counter() - t0
    rows = sft_rows(max(1, tokens // 512), min(tokens, 512), trainer.model.config.vocab_size)
    out = {"dtype": dtype, "mode": "lora" if lora else "full", "tokens": sum(len(r.input_ids) for r in rows),
           "load_s": round(load_s, 1)}
    for key in ("first_step_s", "step_s")[:steps]:
        reset_peak("cpu")
        t0 = time.perf_counter()
        trainer.train_step(rows, sft=True)
        out[key] = round(time.perf_counter() - t0, 1)
        out[key[:-2] + "_rss_peak_gib"] = round(peak_mem_mb("cpu")[0] / 1024, 2)
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def generation(model: str, dtype: str, batch: int, new_tokens: int) -> dict:
    from quaero.config import SamplerConfig
    from quaero.models.load import load_causal_lm, load_tokenizer
    from quaero.sampling.hf import HFSampler

    tok = load_tokenizer(model)
    lm = load_causal_lm(model, dtype)
    system = "You are a tool-using assistant. " * 40  # ~280 tokens, as toolbench's system prompt and tools
    chats = [[{"role": "system", "content": system},
              {"role": "user", "content": f"Question {i}: what is the price of P{i}?"}] for i in range(batch)]
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
               for c in chats]
    sampler = HFSampler(lm, SamplerConfig(temperature=0.7, max_tokens=new_tokens),
                        stop_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    sampler.generate(prompts[:1], seed=0)  # warm-up
    t0 = time.perf_counter()
    done = sampler.generate(prompts, seed=1)
    wall = time.perf_counter() - t0
    n = sum(len(c[0].token_ids) for c in done)
    out = {"dtype": dtype, "batch": batch, "prompt_tokens": len(prompts[0]), "generated_tokens": n,
           "seconds": round(wall, 1), "tokens_per_s": round(n / wall, 1)}
    print(json.dumps(out), file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", default="512,2048")
    p.add_argument("--modes", default="full,lora")
    p.add_argument("--gen-batch", type=int, default=8)
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--steps", type=int, default=2, choices=(1, 2), help="1: the first step only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    doc = {"model": args.model, "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M"),
           "steps": [], "generation": []}
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                doc["steps"].append(time_steps(args.model, dtype, mode == "lora", tokens, args.steps))
        if args.gen_batch:
            doc["generation"].append(generation(args.model, dtype, args.gen_batch, args.gen_tokens))
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
