"""`quaero inspect rows`: the trained rows a run saved (quaero/recipe/saved_rows.py), rendered and verified
offline.

`quaero inspect rows RUN [--step N] [--html OUT] [--verify]` renders the rows with each span coloured
by kind (decoded with the run's tokenizer) or re-checks them: `--verify` checks each row's action spans
against `sampled_actions`, the sampler's own action ids saved beside it (the row alone could not prove its
own tokens). It reads the saved dicts, never `EchoRow.from_dict`: a corrupted row must be reported, not
refused on construction.

What it writes (`--html OUT`, `--export FMT OUT`) is a new file of the user's: never a link or a special
file, never a path inside a run folder (one holding events.jsonl or checkpoints/: a run's own files are not
output), and an existing file only with `--force` (quaero/tools/outputs.py `check_output`).
"""
from __future__ import annotations

import html
import json
import re
import sys
from pathlib import Path

from quaero.recipe.saved_rows import rows_dir, step_file
from quaero.rows import ECHO_KINDS
from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger
from quaero.tools.outputs import OutputRefused, check_output, write_replacing

log = get_logger(__name__)

KINDS = ("prompt", "action", "env", "scaffold", "corrective")
ANSI = {"prompt": "2", "action": "1;32", "env": "36", "scaffold": "33", "corrective": "1;31", "": "35"}
CSS = {"prompt": "#888", "action": "#1a7f37", "env": "#0969da", "scaffold": "#9a6700",
       "corrective": "#cf222e",
       "": "#8250df"}


# ── reading ────────────────────────────────────────────────────────────────────────────────────


class InspectError(ValueError):
    """A run folder without saved rows, or a step that was not saved."""


def _save_rows_setting(run_dir: Path) -> str | None:
    """The run's `[logging] save_rows`, from the config.json it wrote (None when unreadable)."""
    try:
        return json.loads((Path(run_dir) / names.CONFIG).read_text())["logging"]["save_rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_rows(run_dir: Path, step: int | None = None) -> tuple[list[dict], int]:
    """The saved rows of the run (of one step) and how many lines were not saved rows (not UTF-8 JSON, or
    not a row's shape: a torn, edited or foreign file); InspectError when no row is readable."""
    folder = rows_dir(run_dir)
    files = sorted(folder.glob("step-*.jsonl"))
    if not files:
        saving = _save_rows_setting(run_dir)
        if saving in ("sample", "all"):  # coding_tools_env without its key: no episode, so no row to save
            raise InspectError(f"{folder}: no saved rows, although the run saved them (save_rows = "
                               f"{saving!r}): its steps trained no row; `quaero review {run_dir}` says why")
        raise InspectError(f"{folder}: no saved rows; train with [logging] save_rows = \"sample\" or \"all\"")
    if step is not None:
        files = [f for f in files if f.name == step_file(run_dir, step).name]
        if not files:
            raise InspectError(f"{folder}: step {step} was not saved; saved: "
                               f"{', '.join(f.stem for f in sorted(folder.glob('step-*.jsonl')))}")
    records, unreadable = [], 0
    for f in files:
        try:
            lines = f.read_bytes().splitlines()
        except OSError as e:
            raise InspectError(f"{f}: cannot read it ({e.strerror or e})") from None
        for line in filter(bytes.strip, lines):
            try:
                rec = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                rec = None
            if _is_row(rec):
                records.append(rec)
            else:
                unreadable += 1
    if not records:
        raise InspectError(f"{folder}: no readable row in {unreadable} line(s) (not UTF-8 JSON rows that "
                           "quaero saved); pass a run folder that `quaero train` wrote")
    return records, unreadable


def _ints(values) -> bool:
    return isinstance(values, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _numbers(values) -> bool:
    return isinstance(values, list) and all(isinstance(v, (int, float)) and not isinstance(v,
                                                                                           bool)
                                            for v in values)


def _is_row(rec) -> bool:
    """The shape `row_record` writes and render and verify read."""
    if not isinstance(rec, dict) or not _ints(rec.get("input_ids")) or not isinstance(rec.get("spans"), list):
        return False
    if not all(_numbers(rec.get(k)) for k in ("advantages", "echo_weights", "sampler_logprobs")):
        return False
    if not all(isinstance(sp, list) and len(sp) == 4 and sp[0] in KINDS and _ints(sp[1:])
               for sp in rec["spans"]):
        return False
    sampled = rec.get("sampled_actions", [])
    return (isinstance(sampled, list) and all(isinstance(a, dict) and isinstance(a.get("turn"), int)
                                              and _ints(a.get("action_ids")) for a in sampled)
            and isinstance(rec.get("phase"), str) and _ints([rec.get("step"), rec.get("row")])
            and (rec.get("policy_version") is None or _ints([rec.get("policy_version")])))


def run_tokenizer(run_dir: Path):
    """The run's tokenizer, named by its config.json's [model] name."""
    from quaero.models.load import load_tokenizer

    return load_tokenizer(run_model_name(run_dir))


def run_model_name(run_dir: Path) -> str:
    """The run's config.json's [model] name."""
    cfg = Path(run_dir) / names.CONFIG
    if not cfg.exists():
        raise InspectError(f"{cfg}: missing; inspect needs the run's config to find its tokenizer")
    try:
        name = json.loads(cfg.read_bytes().decode("utf-8"))["model"]["name"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise InspectError(f"{cfg}: not a quaero run config (no [model] name); pass a run folder that "
                           "`quaero train` wrote") from None
    if not isinstance(name, str):
        raise InspectError(f"{cfg}: [model] name={name!r} is not a model name")
    return name


def special_ids(tokenizer) -> set[int]:
    """Ids no environment text may encode to: the tokenizer's special ids and its added special tokens."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return set(tokenizer.all_special_ids) | {i for i, tok in added.items() if getattr(tok, "special", False)}


# ── verify ─────────────────────────────────────────────────────────────────────────────────────


def verify_record(rec: dict, specials: set[int], vocab_size: int | None = None) -> list[str]:
    """The problems of one saved row, each naming its step, row and span; `vocab_size`: the ids a row may hold
    (the model's embedding rows), unchecked when None."""
    where = f"step {rec.get('step')} row {rec.get('row')}"
    ids, adv, w = rec["input_ids"], rec["advantages"], rec["echo_weights"]
    n = len(ids)
    if not len(adv) == len(w) == len(rec["sampler_logprobs"]) == n:
        return [f"{where}: per-token lists differ in length from input_ids ({n})"]
    outside = next((i for i, t in enumerate(ids) if not 0 <= t < (vocab_size or t + 1)), None)
    if outside is not None:
        return [(f"{where} token {outside}: id {ids[outside]} outside the model's vocabulary "
                 f"(0..{vocab_size - 1})")]
    sampled = {a["turn"]: a["action_ids"] for a in rec.get("sampled_actions", [])}
    kind_of = [""] * n
    problems = []
    for k, (kind, start, end, turn) in enumerate(rec["spans"]):
        span = f"{where} span {k} ({kind} [{start},{end}) turn {turn})"
        if not 0 <= start <= end <= n:
            problems.append(f"{span}: outside the row's {n} tokens")
            continue
        kind_of[start:end] = [kind] * (end - start)
        if kind == "action":
            if turn not in sampled:
                problems.append(f"{span}: no sampled action ids saved for turn {turn}")
            elif ids[start:end] != sampled[turn]:
                at = next((j for j, (a, b) in enumerate(zip(ids[start:end], sampled[turn])) if a != b),
                          min(end - start, len(sampled[turn])))
                problems.append(f"{span}: ids differ from the sampler's action ids at offset {at}")
        if kind == "env":  # scaffold spans hold the template's own special tokens (<|im_start|>) by design
            bad = sorted({i for i in ids[start:end] if i in specials})
            if bad:
                problems.append(f"{span}: special token id(s) {bad} inside environment text")
    action_turns = {turn for kind, _, _, turn in rec["spans"] if kind == "action"}
    problems += [f"{where}: turn {t}'s sampled action ids have no action span" for t in sampled
                 if t not in action_turns]
    for i in range(n):
        if adv[i] != 0.0 and kind_of[i] != "action":
            problems.append(f"{where} token {i}: advantage {adv[i]} on a {kind_of[i] or 'unlabelled'} token")
        if w[i] != 0.0 and kind_of[i] not in ECHO_KINDS:
            problems.append(f"{where} token {i}: ECHO weight {w[i]} on a {kind_of[i] or 'unlabelled'} token")
    return problems


def verify(records: list[dict], tokenizer, vocab_size: int | None = None) -> list[str]:
    """Every record's problems; `vocab_size` defaults to the tokenizer's length."""
    specials, vocab_size = special_ids(tokenizer), vocab_size or len(tokenizer)
    return [p for rec in records for p in verify_record(rec, specials, vocab_size)]


# ── render ─────────────────────────────────────────────────────────────────────────────────────


def pieces(rec: dict, tokenizer) -> list[tuple[str, str, str]]:
    """(kind, label, decoded text) per span in token order; tokens no span covers come out with kind ''."""
    ids, out, pos = rec["input_ids"], [], 0
    for kind, start, end, turn in sorted(rec["spans"], key=lambda s: s[1]):
        if start > pos:
            out.append(("", f"unlabelled [{pos},{start})", tokenizer.decode(ids[pos:start])))
        out.append((kind, f"{kind} turn {turn} [{start},{end})", tokenizer.decode(ids[start:end])))
        pos = max(pos, end)
    if pos < len(ids):
        out.append(("", f"unlabelled [{pos},{len(ids)})", tokenizer.decode(ids[pos:])))
    return out


def _sampled_by(rec: dict) -> str:
    version = rec.get("policy_version")
    return "oracle demo" if version is None else f"policy v{version}"


def header(rec: dict) -> str:
    adv = next((a for a in rec["advantages"] if a != 0.0), 0.0)
    return (f"── step {rec['step']} row {rec['row']} · {rec['phase']} · {_sampled_by(rec)} · "
            f"{len(rec['input_ids'])} tokens · {len(rec['spans'])} spans · advantage {adv:+.3f} · "
            f"ECHO tokens {sum(1 for w in rec['echo_weights'] if w > 0)}")


# C0 controls but newline and tab, DEL, C1 controls, and the bidi overrides that reorder what a terminal shows
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """`text` with every control character written as its escape (`\\x1b`, `\\r`, `\\u202e`): env text in a
    row is the env's, and an ANSI/OSC sequence in it (clear screen, window title, hyperlink) or a carriage
    return (overwrite the line) must not reach the terminal as a command."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def render_terminal(records: list[dict], tokenizer, *, color: bool) -> str:
    """ANSI colours by span kind on a terminal; `[kind]...[/kind]` markers otherwise (pipes, files). The
    rows' own text is escaped (`terminal_safe`) either way."""
    lines = []
    for rec in records:
        lines.append(terminal_safe(header(rec)))
        text = []
        for kind, _, piece in pieces(rec, tokenizer):
            name, piece = kind or "unlabelled", terminal_safe(piece)
            text.append(f"\x1b[{ANSI[kind]}m{piece}\x1b[0m" if color else f"[{name}]{piece}[/{name}]")
        lines.append("".join(text))
    if color:
        lines.append("legend: " + " ".join(f"\x1b[{ANSI[k]}m{k}\x1b[0m" for k in KINDS))
    return "\n".join(lines)


def render_html(records: list[dict], tokenizer, title: str) -> str:
    """A self-contained page: one <span class="span KIND"> per span, its range in the title attribute."""
    style = "".join(f".span.{k or 'unlabelled'}{{color:{c}}}" for k, c in CSS.items())
    legend = " ".join(f'<b class="legend" style="color:{CSS[k]}">{k}</b>' for k in KINDS)
    body = []
    for rec in records:
        spans = "".join(f'<span class="span {kind or "unlabelled"}" title="{html.escape(label)}">'
                        f"{html.escape(piece)}</span>" for kind, label, piece in pieces(rec, tokenizer))
        body.append(f"<h3>{html.escape(header(rec))}</h3><pre>{spans}</pre>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>body{{font-family:sans-serif}}pre{{white-space:pre-wrap;background:#f6f8fa;padding:8px}}"
            f".span.action{{font-weight:bold}}{style}</style></head><body><h2>{html.escape(title)}</h2>"
            f"<p>legend: {legend}</p>{''.join(body)}</body></html>\n")


def main(args) -> int:
    """`quaero inspect rows`: render (terminal, --html) or --verify; exit 1 on problems or a missing
    folder."""
    try:
        exported = (getattr(args, "export", None) or [None, None])[1]
        for flag, out in (("--html", args.html), ("--export", exported)):
            if out is not None:
                check_output(out, flag, run_dir=args.run_dir, force=getattr(args, "force", False))
        records, unreadable = load_rows(args.run_dir, args.step)
        tokenizer = None if getattr(args, "export", None) else run_tokenizer(args.run_dir)
    except (InspectError, OutputRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if unreadable:
        print(f"warning: {rows_dir(args.run_dir)}: {unreadable} line(s) are not saved rows (not UTF-8 JSON "
              "rows) and are left out", file=sys.stderr)
    if getattr(args, "export", None):
        return export_main(args.run_dir, records, *args.export)
    if args.verify:
        from quaero.rollout.traces import vocab_size_of

        vocab_size = vocab_size_of(run_model_name(args.run_dir))  # a sampler may return ids past the tokens
        problems = verify(records, tokenizer, vocab_size) + ([f"{unreadable} unreadable line(s)"]
                                                             if unreadable else [])
        for p in problems:
            print(terminal_safe(p))
        steps = len({r["step"] for r in records})
        if problems:
            print(f"{len(problems)} problem(s) in {len(records)} rows of {steps} step(s)", file=sys.stderr)
            return 1
        spans = sum(len(r["spans"]) for r in records)
        print(f"verified {len(records)} rows of {steps} step(s), {spans} spans: action ids equal the "
              "sampler's, no special token in environment text, advantages only on actions, ECHO weights "
              "only on env/scaffold")
        return 0
    if args.html:
        try:
            write_replacing(Path(args.html), render_html(records, tokenizer, f"rows of {args.run_dir}"))
        except OSError as e:
            print(f"error: --html {args.html}: cannot write it ({e.strerror or e}); name a file in a "
                  "writable folder", file=sys.stderr)
            return 1
    print(render_terminal(records, tokenizer, color=sys.stdout.isatty()))
    if args.html:
        print(f"wrote {args.html}")
    return 0


def export_main(run_dir: str, records: list[dict], fmt: str, out: str) -> int:
    """`--export FORMAT OUT.jsonl` (quaero/rollout/traces.py): one line per saved row; exit 1 on an unknown
    format."""
    from quaero.rollout.traces import export_rows

    if fmt not in ("rfc010", "openenv-trace"):
        print(f"error: --export {fmt!r}: expected 'rfc010' or 'openenv-trace'", file=sys.stderr)
        return 1
    try:
        lines, skipped = export_rows(records, Path(run_dir), fmt)
        write_replacing(Path(out), "".join(lines))  # checked by main (check_output); never through a link
        written = len(lines)
    except OSError as e:  # a full disk (/dev/full), a folder gone, the run's config.json unreadable
        what = (f"{e.filename}: cannot read it" if e.filename and str(e.filename) != str(out)
                else "cannot write it")
        print(f"error: --export {out}: {what} ({e.strerror or e}); name a file in a writable folder with "
              "free space", file=sys.stderr)
        return 1
    for reason in skipped:
        print(f"skipped {reason}", file=sys.stderr)
    print(f"wrote {written} {fmt} record(s) of {len(records)} saved rows to {out}")
    return 0
