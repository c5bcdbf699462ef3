"""Export and evaluation with real files: the trainer's checkpoint -> a Hugging Face folder or PEFT
adapter -> transformers / peft load -> the trainer's logits; `quaero eval` on the real toolbench
server with scripted policies (a known paired difference) and with an exported tiny-qwen3 folder."""
import json
from pathlib import Path

import pytest
import torch

from quaero import cli
from quaero.config import load_config
from quaero.recipe import checkpoint
from quaero.tools.export import build_trainer, export_run

ROOT = Path(__file__).resolve().parents[2]
TOOLBENCH = str(ROOT / "envs" / "toolbench.toml")
PROMPT = "<|im_start|>user\nWhich customer ordered P3?<|im_end|>\n<|im_start|>assistant\n"


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def prompt_ids(qwen3_tokenizer):
    return torch.tensor([qwen3_tokenizer.encode(PROMPT)])


def checkpointed_run(root: Path, name: str, *, lora: bool):
    """A run folder holding config.json and one checkpoint of a trainer whose trained weights were moved
    off the base model's (every weight, or the LoRA B matrices that start at zero)."""
    cfg = load_config(TOOLBENCH, [f"run.output_dir={root}", f"run.name={name}",
                                  f"backend.lora={str(lora).lower()}"])
    trainer = build_trainer(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in trainer.model.named_parameters():
            if p.requires_grad and (not lora or "lora_B" in pname):
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
    checkpoint.save(cfg.run_dir / "checkpoints", 3, {"step": 3, "cursor": 0, "backend": trainer.state_dict(),
                                                      "rng": checkpoint.rng_state(), "cumulative": {}})
    return cfg.run_dir, trainer


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    return checkpointed_run(tmp_path_factory.mktemp("export") / "runs", "full", lora=False)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    return checkpointed_run(tmp_path_factory.mktemp("export") / "runs", "lora", lora=True)


@pytest.fixture(scope="module")
def full_export(full_run):
    run_dir, _ = full_run
    return export_run(run_dir, run_dir.parent.parent / "exported")


def test_full_finetune_export_is_a_standard_folder_with_the_trainers_logits(full_run, full_export, prompt_ids,
                                                                            tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, trainer = full_run
    names = {p.name for p in full_export.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja"} <= names
    assert not [n for n in names if n.startswith(".") or n == "adapter_config.json"]
    # the trainer's is False
    assert json.loads((full_export / "config.json").read_text())["use_cache"] is True
    exported = logits(AutoModelForCausalLM.from_pretrained(full_export), prompt_ids)
    torch.testing.assert_close(exported, logits(trainer.model, prompt_ids), atol=1e-5, rtol=0)
    base = logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir), prompt_ids)
    assert (exported - base).abs().max() > 1e-2  # the trained weights were written, not the base's
    tok = AutoTokenizer.from_pretrained(full_export)
    assert tok.encode(PROMPT) == prompt_ids[0].tolist() and tok.chat_template


@pytest.mark.slow
def test_lora_export_is_a_peft_adapter_and_merge_gives_the_same_logits(lora_run, prompt_ids, tmp_path,
                                                                       tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir, trainer = lora_run
    adapter = export_run(run_dir, tmp_path / "adapter")
    names = {p.name for p in adapter.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert "model.safetensors" not in names and "config.json" not in names
    base_ref = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base_ref) == tiny_model_dir.resolve()  # loadable as written, not an unresolvable alias
    expected = logits(trainer.model, prompt_ids)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_ref), adapter)
    adapter_logits = logits(peft_model, prompt_ids)
    torch.testing.assert_close(adapter_logits, expected, atol=1e-5, rtol=0)
    assert (adapter_logits - logits(AutoModelForCausalLM.from_pretrained(base_ref),
                                    prompt_ids)).abs().max() > 1e-2

    assert cli.main(["export", str(run_dir), str(tmp_path / "merged"), "--merge", "--step", "3"]) == 0
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    merged = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), prompt_ids)
    torch.testing.assert_close(merged, adapter_logits, atol=1e-5, rtol=0)


@pytest.mark.hostile
def test_export_refuses_a_used_folder_and_names_the_kept_steps(full_run, full_export, capsys):
    run_dir, _ = full_run
    assert cli.main(["export", str(run_dir), str(full_export)]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert cli.main(["export", str(run_dir), str(full_export.parent / "other"), "--step", "7"]) == 1
    err = capsys.readouterr().err
    assert "--step 7: no such checkpoint; kept: step-000003" in err and err.count("\n") == 1
    assert cli.main(["export", str(full_export), str(full_export.parent / "x")]) == 1  # not a run folder
    assert "config.json: not a quaero run config" in capsys.readouterr().err
    import shutil

    torn = shutil.copytree(run_dir, full_export.parent / "torn-run")  # every checkpoint corrupt
    (torn / "checkpoints" / "step-000003" / "tensors.safetensors").write_bytes(b"torn")
    assert cli.main(["export", str(torn), str(full_export.parent / "y")]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [(f"error: {torn / 'checkpoints'}: no intact checkpoint to resume from (step-000003: "
                    "tensors.safetensors does not match its manifest hash (torn or corrupt)); train the run "
                    "again (quaero train CONFIG --restart)")]


@pytest.mark.hostile
def test_export_to_a_file_a_path_below_a_file_or_a_full_disk_is_one_line(full_run, tmp_path, capsys,
                                                                         monkeypatch):
    """Bad destinations: a file (also /dev/full), a folder below a file, a disk that fills mid-write (the
    fault: save_pretrained raising ENOSPC). Each is `error: OUT: ...` naming the fix; no temporary folder
    stays."""
    import errno

    run_dir, _ = full_run
    taken = tmp_path / "taken"
    taken.write_text("mine")
    for out, why in ((taken, "a file, not a folder; name a new folder for the export"),
                     (Path("/dev/full"), "a file, not a folder; name a new folder for the export"),
                     (taken / "below", f"a file ({taken}), not a folder; name a new folder for the export")):
        assert cli.main(["export", str(run_dir), str(out)]) == 1
        assert capsys.readouterr().err == f"error: {out}: {why}\n"  # before any model loads
    assert taken.read_text() == "mine"
    from transformers import PreTrainedModel

    def full(self, folder, **kwargs):
        (Path(folder) / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    assert cli.main(["export", str(run_dir), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.endswith(f"\nerror: {tmp_path / 'out'}: cannot write the model there (No "
                                            "space left on device); choose a writable folder with room for "
                                            "it\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no .out-* temporary folder left


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.hostile
@pytest.mark.slow
def test_eval_compare_oracle_vs_wrong_answers_on_toolbench(tmp_path, capsys):
    """The known-good (the env's oracle) and known-bad (same lookups, wrong answer) policies through
    the same driver and scoring: A wins every pair, so the paired difference is exactly +1."""
    code = cli.main(["eval", TOOLBENCH, "--set", f"run.output_dir={tmp_path}", "--tasks", "6", "--compare",
                     "envs.toolbench:oracle_policy", "fixtures.scripted:wrong_answer_policy"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    out = next((tmp_path / "toolbench").glob("eval-*"))  # the default: the config's run folder
    assert list((out / "env-servers").glob("server-*.log"))  # the env server's log is kept beside the results
    summary = json.loads((out / "summary.json").read_text())
    good, bad = summary["results"]
    assert (good["successes"], good["finished"], good["reward_mean"]) == (6, 6, 1.0)
    assert (bad["successes"], bad["finished"], bad["reward_mean"]) == (0, 6, 0.0)
    assert good["success_ci95"][1] == 1.0 and bad["success_ci95"][0] == 0.0
    assert good["malformed_actions"] == bad["malformed_actions"] == 0 and good["dropped"] == 0
    # the wrong answers are well-formed actions: the whole difference is the task, none of it the format
    assert good["well_formed"] == bad["well_formed"] == 1.0
    assert (good["success_among_well_formed"], bad["success_among_well_formed"]) == (1.0, 0.0)
    split = summary["paired"]["format_task"]
    assert split["format_a_only"] == split["format_b_only"] == 0
    assert good["turns_mean"] == bad["turns_mean"] == 2.0  # difficulty 1: one lookup, then submit_answer
    p = summary["paired"]
    assert (p["pairs"], p["a_only"], p["b_only"], p["success_diff"]) == (6, 6, 0, 1.0)
    assert p["mcnemar_p"] == pytest.approx(2 / 2**6)
    assert p["reward_diff"] == 1.0 and p["reward_diff_ci95"] == [1.0, 1.0]
    a, b = read_jsonl(out / "transcripts-a.jsonl"), read_jsonl(out / "transcripts-b.jsonl")
    assert [r["task"] for r in a] == [r["task"] for r in b] == list(range(6))
    assert [r["seed"] for r in a] == [r["seed"] for r in b]  # identical tasks and seeds
    submitted = [m for m in b[0]["messages"] if m["role"] == "assistant"][-1]["tool_calls"][0]["function"]
    assert submitted == {"name": "submit_answer", "arguments": {"answer": "no answer"}}
    assert (
        "A - B on 6 paired episodes: success +1.000 (A only 6, B only 0; McNemar exact p = 0.03125)"
        in printed
    )
    assert ("B -> A, format: well-formed episodes 1.000 -> 1.000 (well formed only in A 0, only in B 0; "
            "McNemar exact p = 1); task: success among well-formed 0.000 -> 1.000") in printed


def test_eval_an_exported_folder_end_to_end(full_export, tmp_path, capsys):
    """`quaero eval --model <folder quaero export wrote>`: greedy tiny-qwen3 on 2 tasks x 2 seeds. The eval is
    under test, not the sampler: hf, since `auto` is vLLM wherever it imports (tests/engines/ test vLLM)."""
    code = cli.main(["eval", TOOLBENCH, "--set", "sampler.max_tokens=12", "--set", "env.max_turns=2",
                     "--set", "sampler.backend=hf", "--set", f"run.output_dir={tmp_path}",
                     "--model", str(full_export), "--tasks", "2", "--seeds", "2"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert not list(full_export.parent.glob("eval-*"))  # never beside the model folder it only reads
    out = next((tmp_path / "toolbench").glob("eval-*"))  # the config's run folder
    records = read_jsonl(out / "transcripts.jsonl")
    assert [(r["repeat"], r["task"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in records:
        assert {"task", "seed", "messages", "reward", "success", "turns"} <= set(r)
        assert r["messages"][0]["role"] == "system" and any(m["role"] == "assistant" for m in r["messages"])
    # greedy, and toolbench picks the task by index: the second seed repeats the first exactly
    assert [r["messages"] for r in records[:2]] == [r["messages"] for r in records[2:]]
    s = json.loads((out / "summary.json").read_text())["results"][0]
    assert s["model"] == str(full_export) and s["episodes"] == 4 and s["finished"] + s["dropped"] == 4
    assert f"{s['model']}: success {s['successes']}/{s['finished']}" in printed


@pytest.mark.slow
def test_eval_adapter_folder_equals_its_run(lora_run, tmp_path, capsys):
    """An adapter folder (merged onto its base at load) and the run it came from (no final/: its newest
    checkpoint, exported on the fly) are one model: every paired episode agrees. The config's sampler is
    `auto`: with an adapter among the contestants both sample with hf, vLLM installed or not."""
    run_dir, _ = lora_run
    export_run(run_dir, tmp_path / "adapter")
    code = cli.main(["eval", TOOLBENCH, "--set", "sampler.max_tokens=12", "--set", "env.max_turns=1",
                     "--compare", str(tmp_path / "adapter"), str(run_dir), "--tasks", "2",
                     "--out", str(tmp_path / "cmp")])
    assert code == 0, capsys.readouterr()
    a, b = (
        read_jsonl(tmp_path / "cmp" / "transcripts-a.jsonl"),
        read_jsonl(tmp_path / "cmp" / "transcripts-b.jsonl"),
    )
    assert [r["messages"] for r in a] == [r["messages"] for r in b]
    paired = json.loads((tmp_path / "cmp" / "summary.json").read_text())["paired"]
    assert paired["a_only"] == paired["b_only"] == 0 and paired["mcnemar_p"] == 1.0


@pytest.mark.hostile
def test_eval_rejects_an_unknown_model_in_one_line(tmp_path, capsys):
    assert cli.main(["eval", TOOLBENCH, "--model", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: --model {tmp_path / 'nowhere'}: not a run folder") and err.count("\n") == 1
    for name, text in (("config.json", "[1"), ("adapter_config.json", '{"x": 1}')):  # foreign model folders
        folder = tmp_path / name.split(".")[0]
        folder.mkdir()
        (folder / name).write_text(text)
        assert cli.main(["eval", TOOLBENCH, "--model", str(folder)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: --model {folder}: {folder / name} is not a Hugging Face model config "
                              "(")
        assert err.count("\n") == 1


# ── whole runs ───────────────────────────────────────────────────────────────────────────────────────

# one warm-start step on the oracle's demos: unlike an RL step on a random model (all rewards 0, malformed
# actions), it always moves the weights; nothing samples, so hf (`auto` would start vLLM's engine where it
# imports)
TINY_RUN = ["training.steps=0", "training.warmup_sft_steps=1", "rollout.tasks_per_step=1",
            "rollout.group_size=1",
            "training.eval_every=0", "training.eval_tasks=0", "training.checkpoint_every=1",
            "sampler.max_tokens=8",
            "sampler.backend=hf",
            "env.max_turns=2", "env.launcher=inprocess", "logging.console=none", "logging.progress=false"]


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_finished_run_leaves_final_equal_to_its_last_checkpoint(tmp_path, prompt_ids, lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from quaero.recipe.train import train
    from quaero.telemetry.runlog import read_events
    from quaero.tools.export import load_checkpoint

    cfg = load_config(TOOLBENCH, [f"run.output_dir={tmp_path}", f"backend.lora={str(lora).lower()}",
                                  *TINY_RUN])
    run_dir = train(cfg)
    events = [e["event"] for e in read_events(run_dir / "events.jsonl")[0]]
    assert events[-2:] == ["final_saved", "run_end"]
    final = run_dir / "final"
    assert (final / ("adapter_config.json" if lora else "config.json")).exists()
    step, state = load_checkpoint(run_dir)
    trainer = build_trainer(cfg)
    trainer.load_state_dict(state["backend"])
    expected = logits(trainer.model, prompt_ids)
    if lora:
        base = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), final)
    else:
        loaded = AutoModelForCausalLM.from_pretrained(final)
    assert step == 1
    torch.testing.assert_close(logits(loaded, prompt_ids), expected, atol=1e-5, rtol=0)
    assert not (logits(build_trainer(cfg).model, prompt_ids) == expected).all()  # the step changed the model
