"""The second model family through the trainer's side: a `local` SFT step on rows rendered by tiny-smollm2's
own chat template (its tied LM head, selective and full paths agreeing), the memory plan, a checkpoint and its
resume, and `quaero export` (full and LoRA) giving the trainer's logits back from transformers."""
import json
from pathlib import Path

import pytest
import torch

from quaero.config import load_config
from quaero.recipe import checkpoint
from quaero.tools.export import build_trainer, export_run, load_checkpoint

pytestmark = pytest.mark.smollm2
ROOT = Path(__file__).resolve().parents[2]
TOOLBENCH = str(ROOT / "envs" / "toolbench.toml")
CHAT = [{"role": "system", "content": "Call a tool."}, {"role": "user", "content": "Price of SKU A-12?"},
        {"role": "assistant", "content": '<tool_call>{"name": "lookup_price", "arguments": {"sku": "A-12"}}'
                                         "</tool_call>"}]


def sft_row(tokenizer):
    """The chat rendered by the model's template; the assistant turn's tokens are the SFT targets."""
    from benchmarks.trainstep import row_with_targets

    prompt = tokenizer.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert ids[:len(prompt)] == prompt
    return row_with_targets(ids, [], list(range(len(prompt), len(ids))))


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def config(root: Path, name: str, lora: bool):
    return load_config(TOOLBENCH, [f"run.output_dir={root}", f"run.name={name}", "model.name='tiny-smollm2'",
                                   f"backend.lora={str(lora).lower()}"])


def test_the_memory_plan_reads_the_llama_shape(tiny_smollm2_dir):
    from quaero.preflight.memory_lines import memory_lines

    cfg = load_config(TOOLBENCH, ["model.name='smollm2-135m-instruct'", "model.dtype='bfloat16'"])
    lines = memory_lines(cfg, "cpu")
    assert lines[0].startswith("memory plan 0.135B params (tied embeddings), bfloat16, cpu")
    assert lines[0] == memory_lines(cfg, "cpu")[0]  # read from the table: nothing was built for it
    tiny = memory_lines(load_config(TOOLBENCH, ["model.name='tiny-smollm2'"]), "cpu")
    assert tiny[0].startswith("memory plan 0.007B params (tied embeddings), float32")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_step_checkpoint_resume_and_export_of_tiny_smollm2(tiny_smollm2_dir, tmp_path, lora):
    from transformers import AutoModelForCausalLM

    from quaero.models.load import load_tokenizer
    from quaero.tools.export import load_model

    cfg = config(tmp_path / "runs", "smol", lora)
    trainer = build_trainer(cfg)
    row = sft_row(load_tokenizer("tiny-smollm2"))
    before = logits(trainer.model, row.input_ids)
    trainer.set_lr(1e-2)
    metrics = trainer.train_step([row], sft=True)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values() if isinstance(v, float))
    after = logits(trainer.model, row.input_ids)
    assert (after - before).abs().max() > 1e-3  # the step trained the model
    if not lora:  # the head is the embedding: one tensor, trained once
        assert trainer.model.lm_head.weight.data_ptr() == trainer.model.model.embed_tokens.weight.data_ptr()
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    checkpoint.save(cfg.run_dir / "checkpoints", 1, {"step": 1, "cursor": 0, "backend": trainer.state_dict(),
                                                      "rng": checkpoint.rng_state(), "cumulative": {}})
    step, state = load_checkpoint(cfg.run_dir)
    resumed = build_trainer(cfg)
    resumed.load_state_dict(state["backend"])
    assert step == 1
    torch.testing.assert_close(logits(resumed.model, row.input_ids), after, atol=1e-6, rtol=0)
    out = export_run(cfg.run_dir, tmp_path / "export")
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "chat_template.jinja"} <= names
    if lora:
        assert "adapter_config.json" in names
    else:
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
        torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out), row.input_ids), after,
                                   atol=1e-5, rtol=0)
    torch.testing.assert_close(logits(load_model(out), row.input_ids), after, atol=1e-5, rtol=0)


def test_the_tied_heads_selective_and_full_paths_agree(tiny_smollm2_dir):
    from quaero.models.load import load_tokenizer
    from trainers.registry import trainer_class
    from trainers.spec import TrainerSpec

    row = sft_row(load_tokenizer("tiny-smollm2"))
    got = {}
    for selective in (True, False):
        trainer = trainer_class("local")(TrainerSpec(model="tiny-smollm2", selective_logits=selective), "cpu")
        got[selective] = torch.tensor(trainer.logprobs([row])[0])
    torch.testing.assert_close(got[True], got[False], atol=1e-5, rtol=0)
    scored = got[True][got[True] != 0]  # the assistant turn's tokens (0 elsewhere)
    assert scored.numel() > 10 and (scored < 0).all()
