"""`quaero eval` on bad input: each a one-line error (exit 1) naming what to fix, before or instead of a
traceback; nothing of a model folder's own code runs, and finished episodes are kept."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from quaero import cli

pytestmark = pytest.mark.hostile

ROOT = Path(__file__).resolve().parents[2]
TOOLBENCH = str(ROOT / "envs" / "toolbench.toml")
ORACLE = "envs.toolbench:oracle_policy"
FAST = ["--set", "env.launcher=inprocess", "--set", "sampler.backend=hf", "--set", "sampler.max_tokens=8"]


def eval_error(capsys, *args) -> str:
    code = cli.main(["eval", TOOLBENCH, *FAST, *args])
    # torch logs its own warnings first (W1201 ... _pytree.py) on its first import; quaero's line ends stderr
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and err.endswith(errors[0] + "\n"), err
    return errors[0]


@pytest.mark.parametrize("option", [["--tasks", "-1"], ["--tasks", "0"], ["--seeds", "0"]])
def test_no_episode_to_run_is_refused(tmp_path, capsys, option):
    err = eval_error(capsys, "--set", f"run.output_dir={tmp_path}", "--model", ORACLE, *option)
    assert err == f"error: {option[0]} {option[1]}: at least 1 (an eval of no episode reports nothing)"
    assert not list(tmp_path.rglob("eval-*"))


def test_an_out_that_is_a_file_or_cannot_be_made_is_refused_before_any_episode(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    err = eval_error(capsys, "--model", ORACLE, "--out", str(taken))
    assert err == f"error: --out {taken}: a file, not a folder; name a new folder for the transcripts"
    assert taken.read_text() == "mine"
    err = eval_error(capsys, "--model", ORACLE, "--out", str(taken / "below"))
    assert (
        err
        == f"error: --out {taken / 'below'}: cannot write there (Not a directory); "
        "choose a writable folder (--out DIR)"
    )


def test_a_policy_that_is_not_a_function_or_raises_is_one_line(tmp_path, capsys):
    err = eval_error(capsys, "--set", f"run.output_dir={tmp_path}", "--model", "os:system")
    assert err == ("error: --model='os:system': 'system' is a builtin_function_or_method, not a Python "
                   "function; a scripted policy is `def policy(info) -> (messages -> assistant message)`")
    err = eval_error(capsys, "--set", f"run.output_dir={tmp_path}", "--model",
                     "fixtures.scripted:raising_policy",
                     "--tasks", "1")
    assert err == ("error: --model fixtures.scripted:raising_policy: the scripted policy raised (KeyError: "
                   "'answer'); fix the policy")


def _model_folder(tiny_model_dir: Path, folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    return folder


def test_a_truncated_or_pickled_model_folder_is_one_line_and_never_unpickled(tmp_path, tiny_model_dir,
                                                                             capsys):
    torn = _model_folder(tiny_model_dir, tmp_path / "torn")
    (torn / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes()[:4096])
    err = eval_error(capsys, "--set", f"run.output_dir={tmp_path}", "--model", str(torn), "--tasks", "1")
    assert (
        err.startswith(f"error: --model {torn}: cannot load it (")
        and "pass a folder `quaero export` wrote" in err
    )

    class Payload:
        def __reduce__(self):
            return (Path.write_text, (tmp_path / "pwned", "ran"))

    pickled = _model_folder(tiny_model_dir, tmp_path / "pickled")
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Payload()}))
    err = eval_error(capsys, "--set", f"run.output_dir={tmp_path}", "--model", str(pickled), "--tasks", "1")
    assert err.startswith(f"error: --model {pickled}: cannot load it (")
    assert not (tmp_path / "pwned").exists()


def test_a_folder_with_remote_code_is_refused_without_an_offer_to_run_it(tmp_path, capsys):
    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "evil-arch", "auto_map": {
        "AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}))
    (folder / "evil.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').write('ran')\n")
    err = eval_error(capsys, "--model", str(folder))
    assert err.startswith(f"error: --model {folder}: {folder / 'config.json'} is not a Hugging Face model "
                          "config (")
    assert not (tmp_path / "pwned").exists()


def test_finished_episodes_are_kept_when_the_eval_fails_later(tmp_path, capsys, monkeypatch):
    """An eval of 2 repeats whose second one fails (the fault: the driver raising, as a Ctrl-C would): the
    first repeat's transcripts are written."""
    from quaero.rollout.driver import EpisodeDriver

    real, calls = EpisodeDriver.run, []

    def second_fails(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(EpisodeDriver, "run", second_fails)
    assert cli.main(["eval", TOOLBENCH, *FAST, "--model", ORACLE, "--tasks", "2", "--seeds", "2", "--out",
                     str(tmp_path / "cut")]) == 130  # "interrupted"
    records = [json.loads(line) for line in (tmp_path / "cut" / "transcripts.jsonl").read_text().splitlines()]
    assert [(r["repeat"], r["task"], r["success"]) for r in records] == [(0, 0, True), (0, 1, True)]
