"""Saved rows (quaero/recipe/saved_rows.py, quaero/tools/inspect_rows.py) from real driven episodes (toy env,
real Qwen3 renderer, oracle policy), checked and rendered by the real `quaero inspect rows` CLI in a
subprocess."""
import json
import subprocess
import sys

import pytest
from fixtures.rollout import drive, make_cfg
from fixtures.runs import ROOT

from quaero import cli
from quaero.config import LoggingConfig
from quaero.recipe.saved_rows import save_step_rows, step_file
from quaero.tools.inspect_rows import header, render_terminal, special_ids, verify_record

STEP = 3
IM_START = 151644


@pytest.fixture(scope="module")
def collected(qwen3_render):
    """Three oracle episodes' rows with their advantages, each with its episode's transitions (as train.py's
    _collect returns them)."""
    eps, _ = drive(qwen3_render, tasks=3)
    return [(row.with_advantage(0.25 * (i + 1)), ep.transitions) for i,
                                                               ep in enumerate(eps) for row in ep.rows]


@pytest.fixture
def run_dir(tmp_path, collected):
    run = tmp_path / "runs" / "toy"
    run.mkdir(parents=True)
    (run / "config.json").write_text(make_cfg().model_dump_json(indent=2))
    assert save_step_rows(run, "all", STEP, collected, phase="rl",
                          policy_version=STEP - 1) == {"rows_saved": 3, "rows_save_failures": 0}
    return run


def inspect_rows(run, *args):
    return subprocess.run([sys.executable, "-m", "quaero.cli", "inspect", "rows", str(run), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)


def saved(run):
    return [json.loads(line) for line in step_file(run, STEP).read_text().splitlines()]


def test_saved_rows_hold_the_row_and_the_samplers_own_action_ids(run_dir, collected):
    recs = saved(run_dir)
    assert [r["row"] for r in recs] == [0, 1, 2]
    for rec, (row, transitions) in zip(recs, collected):
        assert rec["step"] == STEP and rec["phase"] == "rl" and rec["policy_version"] == STEP - 1
        assert rec["input_ids"] == row.input_ids and rec["advantages"] == row.advantages
        assert rec["echo_weights"] == row.echo_weights and rec["sampler_logprobs"] == row.sampler_logprobs
        assert rec["spans"] == [[s.kind, s.start, s.end, s.turn] for s in row.spans]
        assert rec["sampled_actions"] == [{"turn": t.turn, "action_ids": t.action_ids} for t in transitions]
    assert not list(run_dir.glob("rows/*.tmp"))


def test_sample_mode_is_the_default_and_keeps_two_rows_none_writes_nothing(tmp_path, collected):
    assert LoggingConfig().save_rows == "sample"
    assert save_step_rows(tmp_path, "sample", 1, collected, phase="sft",
                          policy_version=None)["rows_saved"] == 2
    sft = [json.loads(x) for x in step_file(tmp_path, 1).read_text().splitlines()]
    # the oracle's demos
    assert [(r["phase"], r["policy_version"]) for r in sft] == [("sft", None), ("sft", None)]
    assert header(sft[0]).startswith("── step 1 row 0 · sft · oracle demo · ")
    assert save_step_rows(tmp_path, "none", 2, collected, phase="rl", policy_version=1) == {}
    assert not step_file(tmp_path, 2).exists()


def test_a_save_failure_is_counted_not_raised(tmp_path, collected):
    blocked = tmp_path / "run"
    blocked.mkdir()
    (blocked / "rows").write_text("a file where the rows folder should be")
    assert save_step_rows(blocked, "all", 1, collected, phase="rl", policy_version=0) == {
        "rows_saved": 0,
        "rows_save_failures": 1,
    }


@pytest.mark.slow
def test_verify_passes_on_real_rows(run_dir):
    proc = inspect_rows(run_dir, "--verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("verified 3 rows of 1 step(s)")


@pytest.mark.slow
def test_verify_names_each_corruption_and_exits_1(run_dir):
    recs = saved(run_dir)
    kind_span = {k: next(i for i, s in enumerate(recs[0]["spans"]) if s[0] == k) for k in ("action", "env")}
    a = recs[0]["spans"][kind_span["action"]]
    recs[0]["input_ids"][a[1] + 2] += 1  # one action id no longer what the sampler returned
    e = recs[1]["spans"][kind_span["env"]]
    recs[1]["input_ids"][e[1]] = IM_START  # a special token inside environment text
    recs[2]["advantages"][1] = 0.5  # advantage on a prompt token
    step_file(run_dir, STEP).write_text("".join(json.dumps(r) + "\n" for r in recs))
    proc = inspect_rows(run_dir, "--verify")
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, proc.stdout
    assert lines[0].startswith(f"step {STEP} row 0 span {kind_span['action']} (action [{a[1]},{a[2]}) turn "
                               "0): ids differ from the sampler's action ids at offset 2")
    assert lines[1].startswith(f"step {STEP} row 1 span {kind_span['env']} (env [{e[1]},{e[2]}) turn 0): "
                               f"special token id(s) [{IM_START}]")
    assert lines[2] == f"step {STEP} row 2 token 1: advantage 0.5 on a prompt token"
    assert "3 problem(s) in 3 rows" in proc.stderr


@pytest.mark.slow
def test_render_without_a_tty_marks_spans_and_html_has_one_element_per_span(run_dir, tmp_path):
    page = tmp_path / "rows.html"
    proc = inspect_rows(run_dir, "--step", str(STEP), "--html", str(page))
    assert proc.returncode == 0, proc.stderr
    assert "\x1b[" not in proc.stdout  # a pipe gets markers, not colours
    assert proc.stdout.count("[action]") == proc.stdout.count("[/action]") == sum(
        1 for r in saved(run_dir) for s in r["spans"] if s[0] == "action")
    assert "[env]apple: 3 EUR[/env]" in proc.stdout
    assert f"── step {STEP} row 0 · rl · policy v{STEP - 1}" in proc.stdout
    text = page.read_text()
    assert text.count('<span class="span ') == sum(len(r["spans"]) for r in saved(run_dir))
    assert text.count('class="legend"') == 5
    assert all(f'">{k}</b>' in text for k in ("prompt", "action", "env", "scaffold", "corrective"))
    assert '<span class="span env" title="env turn 0' in text


def test_a_step_that_was_not_saved_is_an_error_naming_the_saved_ones(run_dir, capsys):
    assert cli.main(["inspect", "rows", str(run_dir), "--step", "7"]) == 1
    assert f"step 7 was not saved; saved: step-{STEP:06d}" in capsys.readouterr().err


def test_a_relabelled_action_span_is_caught_and_a_tty_gets_colours(run_dir, qwen3_tokenizer):
    rec = saved(run_dir)[0]
    k = next(i for i, s in enumerate(rec["spans"]) if s[0] == "action")
    rec["spans"][k][0] = "prompt"  # the sampled turn now hides as context
    rec["advantages"] = [0.0] * len(rec["input_ids"])
    assert verify_record(rec, special_ids(qwen3_tokenizer)) == [
        f"step {STEP} row 0: turn {rec['spans'][k][3]}'s sampled action ids have no action span"]
    shown = render_terminal(saved(run_dir)[:1], qwen3_tokenizer, color=True)
    assert (
        "\x1b[1;32m<think>" in shown
        and "[action]" not in shown
        and shown.splitlines()[-1].startswith("legend:")
    )


@pytest.mark.hostile
@pytest.mark.slow
def test_unreadable_or_foreign_lines_are_counted_and_a_foreign_folder_is_one_line(run_dir, tmp_path, capsys):
    with step_file(run_dir, STEP).open("ab") as f:  # a torn, a non-UTF-8, a non-row and a wrong-shaped line
        f.write(b'{"torn\n\xff\xfe\n[1, 2]\n{"input_ids": [1], "spans": [["weird", 0, 1, 0]]}\n')
    assert cli.main(["inspect", "rows", str(run_dir)]) == 0
    assert capsys.readouterr().err == (f"warning: {run_dir / 'rows'}: 4 line(s) are not saved rows (not "
                                       "UTF-8 JSON rows) and are left out\n")
    # integrity: an unreadable line is a problem
    assert cli.main(["inspect", "rows", str(run_dir), "--verify"]) == 1
    assert "1 problem(s) in 3 rows" in capsys.readouterr().err

    foreign = tmp_path / "foreign"
    (foreign / "rows").mkdir(parents=True)
    (foreign / "rows" / "step-000001.jsonl").write_bytes(b'\xff\n{"x": 1}\n')
    (foreign / "config.json").write_text('{"model": 3}')
    assert cli.main(["inspect", "rows", str(foreign), "--verify"]) == 1
    assert capsys.readouterr().err == (f"error: {foreign / 'rows'}: no readable row in 2 line(s) (not UTF-8 "
                                       "JSON rows that quaero saved); pass a run folder that `quaero train` "
                                       "wrote\n")
    (foreign / "rows" / "step-000001.jsonl").write_bytes(step_file(run_dir, STEP).read_bytes())
    assert cli.main(["inspect", "rows", str(foreign)]) == 1
    assert capsys.readouterr().err.endswith(f"error: {foreign / 'config.json'}: not a quaero run config (no "
                                            "[model] name); pass a run folder that `quaero train` wrote\n")


HOSTILE_TEXT = (
    "\x1b]0;pwned\x07\x1b[2J\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\\rOVERWRITE\u202eevil\x9b31m"
)


@pytest.mark.hostile
@pytest.mark.parametrize("color", [False, True])
def test_env_text_with_terminal_escapes_is_shown_escaped(run_dir, qwen3_tokenizer, color, capsys):
    """ANSI/OSC sequences (window title, clear screen, hyperlink), a carriage return, a bidi override and a C1
    CSI in a row's env text reach the terminal as visible escapes, piped or on a terminal."""
    rec = saved(run_dir)[0]
    rec["input_ids"] += qwen3_tokenizer.encode(HOSTILE_TEXT, add_special_tokens=False)
    shown = render_terminal([rec], qwen3_tokenizer, color=color)
    assert "\r" not in shown and "\x07" not in shown and "\u202e" not in shown and "\x9b" not in shown
    assert (
        "\\x1b]0;pwned\\x07\\x1b[2J\\x1b]8;;http://evil\\x1b\\link" in shown
        and "\\rOVERWRITE\\u202eevil" in shown
    )
    if not color:
        assert "\x1b" not in shown  # the markers' own colours are the only escapes on a terminal
        step_file(run_dir, STEP).write_text(json.dumps(rec) + "\n")
        assert cli.main(["inspect", "rows", str(run_dir)]) == 0
        assert "\x1b" not in capsys.readouterr().out
    else:
        assert shown.replace("\x1b[0m", "").count("\x1b[") == shown.count("\x1b[0m")  # one colour per reset


@pytest.mark.hostile
def test_html_to_a_folder_is_one_error_line(run_dir, tmp_path, capsys):
    assert cli.main(["inspect", "rows", str(run_dir), "--html", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: --html {tmp_path}: a folder; name a file in a writable folder\n"
