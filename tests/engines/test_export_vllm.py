"""Exported runs served by vLLM (the CPU build in CI). Two real train steps move tiny-qwen3 off its init
(every weight, or a LoRA adapter), `quaero export` writes the folder (`--merge` for the adapter), and
quaero's vLLM sampler on it continues greedily exactly as transformers does on the same folder, with the
trainer's own log-probs of those tokens. Each folder gets one engine, built the way
`quaero eval --model FOLDER --set sampler.backend=vllm` builds it (an engine reloaded through
`update_weights` is test_sampling's subject)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixtures import require_vllm

from benchmarks.smoke import sparse_rows
from quaero import cli
from quaero.config import load_config
from quaero.recipe import checkpoint
from quaero.rows import EchoRow, Span
from quaero.tools.export import build_trainer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # two engines of its own, built from folders

TOOLBENCH = str(Path(__file__).resolve().parents[2] / "envs" / "toolbench.toml")
STOP = [151645, 151643]
MAX_TOKENS = 16
QUESTIONS = ["Which customer ordered P3?", "What is the price of apple?", "Hello", "List the tools you have."]


def exported_run(root: Path, *, lora: bool):
    """(config, trainer, folder): two RL + ECHO steps on the smoke rows, checkpointed in a run folder and
    exported with the real CLI (a LoRA run with --merge)."""
    name = "lora" if lora else "full"
    cfg = load_config(TOOLBENCH, [f"run.output_dir={root / 'runs'}", f"run.name={name}",
                                  f"backend.lora={str(lora).lower()}", "backend.lr=1e-3",
                                  "sampler.temperature=1.0"])  # the trainer scores as the greedy server does
    trainer = build_trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    for _ in range(2):
        trainer.train_step(sparse_rows())
    moved = [k for k, v in trainer.model.state_dict().items() if not torch.equal(before[k], v)]
    assert moved and all("lora_" in k for k in moved) == lora, moved  # the steps trained what they should
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    checkpoint.save(cfg.run_dir / "checkpoints", 2, {"step": 2, "cursor": 0, "backend": trainer.state_dict(),
                                                      "rng": checkpoint.rng_state(), "cumulative": {}})
    out = root / f"exported-{name}"
    assert cli.main(["export", str(cfg.run_dir), str(out), *(["--merge"] if lora else [])]) == 0
    assert (out / "model.safetensors").exists() and not (out / "adapter_config.json").exists()
    return cfg, trainer, out


@pytest.fixture(scope="module", params=["full", "lora"], ids=["full", "lora-merged"])
def exported(request, tmp_path_factory):
    return exported_run(tmp_path_factory.mktemp("export-vllm"), lora=request.param == "lora")


@pytest.fixture(scope="module")
def served(exported):
    """quaero's vLLM sampler on the exported folder, built as `quaero eval --model FOLDER` builds it."""
    require_vllm()
    from quaero.sampling import make_sampler

    cfg, _, folder = exported
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": str(folder)}),
                                 "sampler": cfg.sampler.model_copy(update={"backend": "vllm",
                                                                           "max_tokens": MAX_TOKENS})})
    sampler = make_sampler(cfg, stop_token_ids=STOP, device="cpu")
    yield sampler
    sampler.close()


def transformers_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """`generate` of the folder loaded by transformers, one prompt at a time (no padding), cut after a stop
    id."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    result = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 eos_token_id=STOP, pad_token_id=STOP[1])
        ids = out[0, len(prompt):].tolist()
        result.append(ids[:next((i + 1 for i, t in enumerate(ids) if t in STOP), len(ids))])
    return result


def trainer_logprobs(trainer, prompt: list[int], action: list[int]) -> torch.Tensor:
    """The trainer's log-probs of `action` after `prompt` (its training forward, temperature 1)."""
    n = len(prompt) + len(action)
    row = EchoRow(prompt + action, [Span("prompt", 0, len(prompt)), Span("action", len(prompt), n)],
                  [0.0] * n, [0.0] * n, [0.0] * n)
    return torch.tensor(trainer.logprobs([row])[0][len(prompt):])


def assert_served_like_trained(sampler, trainer, folder: Path, tiny_lm) -> None:
    """Greedy ids equal transformers' on `folder`; log-probs equal the trainer's, not the untrained
    model's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)  # the exported tokenizer encodes the prompts
    prompts = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS]
    served = [c for (c,) in sampler.generate(prompts, greedy=True)]
    assert [c.token_ids for c in served] == transformers_greedy(folder, prompts)
    gap, moved = 0.0, 0.0
    for prompt, c in zip(prompts, served):
        lps = torch.tensor(c.logprobs)
        gap = max(gap, (lps - trainer_logprobs(trainer, prompt, c.token_ids)).abs().max().item())
        with torch.no_grad():
            untrained = (
                tiny_lm(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            )
        moved = max(
            moved, (lps - untrained.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]).abs().max().item()
        )
    print(f"\n{folder.name}: {sum(len(c.token_ids) for c in served)} greedy tokens over {len(prompts)} "
          f"prompts equal transformers'; max |logprob diff| vs the trainer {gap:.2e}, vs the untrained model "
          f"{moved:.2e}")
    assert gap < 1e-4  # the sampler contract's tolerance (tests/engines/test_sampling.py)
    assert moved > 1e-3  # what is served is the trained model


def test_vllm_serves_the_exported_folder(exported, served, tiny_lm):
    _, trainer, folder = exported
    assert_served_like_trained(served, trainer, folder, tiny_lm)
