"""`quaero inspect rows` (quaero/tools/inspect_rows.py) against hostile output paths and saved rows: what it
writes (`--html`, `--export`) is a new file of the user's, never a run's own file, a symlink's target or an
existing file without `--force`; a write that fails is one line; `--verify` catches ids outside the
vocabulary. Real rows of the toy env (real Qwen3 renderer, oracle policy), the real CLI in process."""
import json
import os

import pytest
from fixtures.rollout import drive, make_cfg

from quaero import cli
from quaero.recipe.saved_rows import save_step_rows, step_file

pytestmark = pytest.mark.hostile


@pytest.fixture(scope="module")
def collected(qwen3_render):
    eps, _ = drive(qwen3_render, tasks=2)
    return [(row.with_advantage(0.5), ep.transitions) for ep in eps for row in ep.rows]


@pytest.fixture
def run_dir(tmp_path, collected):
    """A run folder as `quaero train` leaves it: config.json, events.jsonl, a checkpoint, saved rows."""
    run = tmp_path / "runs" / "toy"
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "checkpoints" / "step-000001" / "tensors.safetensors").write_bytes(b"weights")
    (run / "config.json").write_text(make_cfg().model_dump_json(indent=2))
    (run / "events.jsonl").write_text('{"event": "run_start"}\n')
    save_step_rows(run, "all", 1, collected, phase="rl", policy_version=0)
    return run


def _export(run, out, *more):
    return cli.main(["inspect", "rows", str(run), "--export", "rfc010", str(out), *more])


@pytest.mark.parametrize("target", ["checkpoints/step-000001/tensors.safetensors", "events.jsonl",
                                    "config.json"])
@pytest.mark.parametrize("flag", ["--export", "--html"])
def test_a_path_inside_the_run_folder_is_refused_and_left_untouched(run_dir, capsys, target, flag):
    before = (run_dir / target).read_bytes()
    args = ["--export", "rfc010"] if flag == "--export" else ["--html"]
    assert cli.main(["inspect", "rows", str(run_dir), *args, str(run_dir / target), "--force"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} {run_dir / target}: inside the run folder {run_dir.resolve()}")
    assert err.count("\n") == 1 and (run_dir / target).read_bytes() == before


def test_a_path_inside_another_run_folder_is_refused(run_dir, tmp_path, capsys):
    other = tmp_path / "runs" / "other"
    (other / "checkpoints").mkdir(parents=True)
    assert _export(run_dir, other / "rows.jsonl") == 1
    assert f"inside the run folder {other.resolve()}" in capsys.readouterr().err
    assert not (other / "rows.jsonl").exists()


def test_a_symlink_is_refused_even_with_force(run_dir, tmp_path, capsys):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    link = tmp_path / "out.jsonl"
    link.symlink_to(target)
    assert _export(run_dir, link, "--force") == 1
    assert capsys.readouterr().err.startswith(f"error: --export {link}: a symlink (to {target})")
    assert target.read_text() == "keep me"


def test_an_existing_file_needs_force(run_dir, tmp_path, capsys):
    out = tmp_path / "mine.jsonl"
    out.write_text("user data\n")
    assert _export(run_dir, out) == 1
    assert "already exists; choose a new file or pass --force" in capsys.readouterr().err
    assert out.read_text() == "user data\n"
    assert _export(run_dir, out, "--force") == 0
    assert [json.loads(line)["quaero"]["step"] for line in out.read_text().splitlines()] == [1] * len(
        step_file(run_dir, 1).read_text().splitlines())


def test_a_device_is_refused_as_a_special_file(run_dir, capsys):
    assert _export(run_dir, "/dev/full", "--force") == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --export /dev/full: a special file (a FIFO, socket or device)")
    assert err.count("\n") == 1


@pytest.mark.parametrize("flag", ["--export", "--html"])
def test_a_hard_link_to_a_runs_config_is_refused_even_with_force(run_dir, tmp_path, capsys, flag):
    """`--html OUT --force` with OUT a hard link to the run's config.json turned the config into the page."""
    config = run_dir / "config.json"
    before = config.read_bytes()
    out = tmp_path / "page.html"
    os.link(config, out)
    args = ["--export", "rfc010"] if flag == "--export" else ["--html"]
    assert cli.main(["inspect", "rows", str(run_dir), *args, str(out), "--force"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {flag} {out}: a hard link (2 names for one file") and err.count("\n") == 1
    assert config.read_bytes() == before and out.read_bytes() == before


@pytest.mark.parametrize("flag", ["--export", "--html"])
def test_a_fifo_is_refused_without_blocking_or_writing(run_dir, tmp_path, capsys, flag):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a regression would write here rather than hang
    try:
        args = ["--export", "rfc010"] if flag == "--export" else ["--html"]
        assert cli.main(["inspect", "rows", str(run_dir), *args, str(fifo), "--force"]) == 1
        assert capsys.readouterr().err.startswith(f"error: {flag} {fifo}: a special file")
        assert os.read(reader, 100) == b""
    finally:
        os.close(reader)


def test_verify_catches_an_id_outside_the_vocabulary(run_dir, capsys):
    path = step_file(run_dir, 1)
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    recs[0]["input_ids"][0] = 10**9
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert cli.main(["inspect", "rows", str(run_dir), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "step 1 row 0 token 0: id 1000000000 outside the model's vocabulary (0.." in out


@pytest.mark.parametrize("planted", ["symlink", "hard link"])
def test_a_link_planted_after_the_check_is_replaced_not_written_through(run_dir, tmp_path, monkeypatch,
                                                                         planted):
    """`--export` opened OUT itself (`open("w")`): a link planted at OUT after the check was followed and its
    target rewritten. It is now written beside OUT and renamed onto the name (outputs.write_replacing)."""
    from quaero.tools import inspect_rows

    victim, out = tmp_path / "victim.txt", tmp_path / "out.jsonl"
    victim.write_text("keep me")
    real = inspect_rows.check_output

    def check_then_plant(path, flag, **kw):
        checked = real(path, flag, **kw)
        (os.symlink if planted == "symlink" else os.link)(victim, out)
        return checked

    monkeypatch.setattr(inspect_rows, "check_output", check_then_plant)
    assert _export(run_dir, out) == 0
    assert victim.read_text() == "keep me" and not out.is_symlink() and os.stat(victim).st_nlink == 1
    assert json.loads(out.read_text().splitlines()[0])["quaero"]["step"] == 1


def test_an_export_that_cannot_be_written_leaves_no_partial_file(run_dir, tmp_path, monkeypatch, capsys):
    from quaero.tools import outputs

    def full(*a, **kw):
        raise OSError(28, "No space left on device")

    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(outputs.os, "replace", full)
    assert _export(run_dir, out) == 1
    assert "cannot write it (No space left on device)" in capsys.readouterr().err
    assert list(tmp_path.glob("*.jsonl*")) == [] and list(tmp_path.glob(".out.jsonl-*")) == []
