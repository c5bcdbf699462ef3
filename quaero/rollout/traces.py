"""Rows in and out of OpenEnv's two token formats: RFC 010 role masks and `TrainingTrace` capture files.

Out (`quaero inspect rows RUN --export rfc010|openenv-trace OUT.jsonl`), one line per saved row:
- RFC 010 record: `input_ids` and three 0/1 masks over them, `action_mask` (action spans: the policy-gradient
  target), `obs_mask` (env spans: the ECHO target) and `warning_mask` (corrective spans: quaero's message
  after a malformed action, harness text RFC 010 keeps out of the env loss); every other token is context.
  Beside them: per-token `logprobs` (the sampler's, on action tokens), the row's `advantage` and `reward`, and
  the λ it trained with (`world_model_coeff`, `world_loss_target`). `quaero.scaffold_mask` keeps the template
  tokens apart from the prompt, so a record reads back into the very spans it came from.
- `TrainingTrace` (OpenEnv's pydantic model, validated on write): one turn per action span, its prompt the
  row's exact prefix, its completion the sampler's action ids and log-probs, loss mask 1 on the completion.
  The last turn's metadata carries the row's roles and the tokens after the last action (the terminal env
  response), which a trace has no field for.

In (`[data] traces = "path.jsonl"`): both kinds of line rebuilt into `EchoRow`s from their ids, never
re-tokenized. A trace without quaero's roles (from `openenv collect`) reads its turns as: completion with loss
mask 1 = action, each turn's new prompt suffix = env (the ECHO target, template tokens included), the rest
context. A line that is not exact is refused with one reason, counted, never trained: masks that do not cover
the ids or overlap, ids outside the vocabulary, a turn whose prompt does not extend the previous turn's prompt
and completion, roles that disagree with the loss mask.
"""
from __future__ import annotations

import json
import math
from array import array
from pathlib import Path
from typing import Any

from quaero.config import ConfigError
from quaero.rollout.advantages import MAX_ABS_ADVANTAGE, group_advantages
from quaero.rows import EchoRow, RowError, Span
from quaero.telemetry import names
from quaero.telemetry.runlog import get_logger

log = get_logger(__name__)

ROLE_OF_KIND = {"action": "action", "env": "obs", "corrective": "warning", "scaffold": "scaffold",
                "prompt": "context"}
KIND_OF_ROLE = {role: kind for kind, role in ROLE_OF_KIND.items()}


class TraceRefused(ValueError):
    """One input line that is not exact; its message is the reason."""


# ── per-token roles ─────────────────────────────────────────────────────────────────────────────


def token_kinds(n: int, spans: list) -> list[str]:
    """The span kind of every token of a row ("prompt" where no span covers it); spans as saved lists or
    Spans."""
    kinds = ["prompt"] * n
    for s in spans:
        kind, start, end = (s.kind, s.start, s.end) if isinstance(s, Span) else s[:3]
        kinds[start:end] = [kind] * (end - start)
    return kinds


def run_length(items: list[str]) -> list[list]:
    out: list[list] = []
    for item in items:
        if out and out[-1][0] == item:
            out[-1][1] += 1
        else:
            out.append([item, 1])
    return out


def _expand(runs: Any, where: str) -> list[str]:
    if not isinstance(runs, list) or not all(isinstance(r,
                                                        list) and len(r) == 2
                                             and r[0] in KIND_OF_ROLE.values()
                                             and type(r[1]) is int and r[1] > 0 for r in runs):
        raise TraceRefused(f"{where}: roles are not [[kind, count], ...] over quaero's span kinds")
    return [kind for kind, count in runs for _ in range(count)]


def _row_from_kinds(ids: list[int], kinds: list[str], logprobs: list[float], *, include_scaffold: bool,
                    meta: dict) -> EchoRow:
    """An SFT + ECHO row (advantage 1 on every action token, as a warm start's demos) from per-token kinds."""
    spans, actions, start = [], 0, 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or kinds[i] != kinds[start]:
            kind = kinds[start]
            # an action opens its turn; a prompt suffix after it belongs to the next; env text to the last
            # action's
            turn = actions if kind in ("action", "prompt") else max(actions - 1, 0)
            actions += kind == "action"
            spans.append(Span(kind, start, i, turn))
            start = i
    weights = [1.0 if k == "env" or (k == "scaffold" and include_scaffold) else 0.0 for k in kinds]
    if weights:
        weights[0] = 0.0
    row = EchoRow(list(ids), spans, [0.0] * len(ids), weights, [lp if k == "action" else 0.0
                                                                 for lp, k in zip(logprobs, kinds)], meta)
    return row.with_advantage(1.0)


# ── out ─────────────────────────────────────────────────────────────────────────────────────────


def _scalars(rec: dict, run_cfg: dict) -> dict:
    echo = run_cfg.get("echo", {})
    return {"advantage": next((a for a in rec["advantages"] if a != 0.0), 0.0),
            "reward": rec.get("meta", {}).get("reward"),
            "world_model_coeff": echo.get("weight", 0.0) if echo.get("enabled", True) else 0.0,
            "world_loss_target": "all" if echo.get("include_scaffold") else "env_only"}


def _origin(rec: dict, run: str) -> dict:
    return {"run": run, "step": rec["step"], "row": rec["row"], "phase": rec["phase"],
            "policy_version": rec.get("policy_version")}


def _group(rec: dict, run: str) -> dict:
    """The row's group (its task's episodes sampled together: `meta["episode"]` is "step/task/member"), when
    the row names its episode; `[data] traces_loss = "rl"` computes group-relative advantages over it."""
    episode = rec.get("meta", {}).get("episode")
    if not isinstance(episode, str) or episode.count("/") != 2:
        return {}
    return {"group": f"{run}/{episode.rsplit('/', 1)[0]}"}


def to_rfc010(rec: dict, run_cfg: dict, run: str) -> dict:
    """A saved row (quaero/recipe/saved_rows.py `row_record`'s dict) as an RFC 010 record."""
    kinds = token_kinds(len(rec["input_ids"]), rec["spans"])
    mask = lambda kind: [int(k == kind) for k in kinds]
    return {"input_ids": rec["input_ids"], "action_mask": mask("action"), "obs_mask": mask("env"),
            "warning_mask": mask("corrective"), "logprobs": [lp if k == "action" else 0.0 for lp, k in
                                                             zip(rec["sampler_logprobs"], kinds)],
            **_scalars(rec, run_cfg), **_group(rec, run),
            "quaero": {**_origin(rec, run), "scaffold_mask": mask("scaffold")}}


def to_training_trace(rec: dict, run_cfg: dict, run: str) -> dict:
    """A saved row as an OpenEnv `TrainingTrace` (validated by OpenEnv's own model); ValueError for a row with
    no action span (a trace is a list of engine calls, and such a row has none)."""
    from openenv.core.harness.training import TrainingTrace

    ids, lps = rec["input_ids"], rec["sampler_logprobs"]
    actions = sorted((s for s in rec["spans"] if s[0] == "action"), key=lambda s: s[1])
    if not actions:
        raise ValueError(f"step {rec['step']} row {rec['row']}: no action span, so no engine call to record")
    node = f"{run}/step-{rec['step']}/row-{rec['row']}"
    turns = [{"node_id": f"{node}/turn-{k}", "prompt_token_ids": ids[:start],
              "completion_token_ids": ids[start:end],
              "per_token_logps": [min(lp, 0.0) for lp in lps[start:end]],
              "loss_mask": [0] * start + [1] * (end - start), "metadata": {"turn": turn}}
             for k, (_, start, end, turn) in enumerate(actions)]
    turns[-1]["metadata"]["quaero"] = {
        **_origin(rec, run), **_scalars(rec, run_cfg), **_group(rec,
                                                                run), "tail_token_ids": ids[actions[-1][2]:],
        "roles": run_length(token_kinds(len(ids), rec["spans"]))}
    return TrainingTrace.model_validate({"schema_version": 1, "turns": turns}).model_dump(mode="json")


def export_rows(records: list[dict], run_dir: Path, fmt: str) -> tuple[list[str], list[str]]:
    """`records` (saved rows) in `fmt` ("rfc010" | "openenv-trace"): (their JSON lines, the skipped rows'
    reasons). The caller writes the lines (`quaero inspect rows --export` through quaero/tools/outputs.py:
    never through a link, a special file or a run's own file)."""
    run_cfg = json.loads((Path(run_dir) / names.CONFIG).read_text())
    convert = to_rfc010 if fmt == "rfc010" else to_training_trace
    lines, skipped = [], []
    for rec in records:
        try:
            line = convert(rec, run_cfg, Path(run_dir).name)
        except ValueError as e:
            skipped.append(str(e).splitlines()[0])
            continue
        lines.append(json.dumps(line) + "\n")
    return lines, skipped


# ── in ──────────────────────────────────────────────────────────────────────────────────────────


def _ids(values: Any, vocab_size: int, name: str) -> list[int]:
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise TraceRefused(f"{name} is not a list of integer token ids")
    bad = next((v for v in values if not 0 <= v < vocab_size), None)
    if bad is not None:
        raise TraceRefused(f"{name} holds id {bad}, outside the tokenizer's vocabulary "
                           f"(0..{vocab_size - 1}): "
                           "recorded with another tokenizer?")
    return values


def _mask(rec: dict, key: str, n: int) -> list[int]:
    mask = rec.get(key, [0] * n)
    if not isinstance(mask, list) or len(mask) != n or any(m not in (0, 1) or isinstance(m,
                                                                                         float)
                                                           for m in mask):
        raise TraceRefused(f"{key} does not cover the {n} input_ids with 0/1 (or true/false) entries")
    return [int(m) for m in mask]


def _logprobs(values: Any, n: int, name: str) -> list[float]:
    if values is None:
        return [0.0] * n
    if (not isinstance(values, list) or len(values) != n
            or not all(isinstance(v, (int, float)) and not isinstance(v,
                                                                      bool) and math.isfinite(v)
                       for v in values)):
        raise TraceRefused(f"{name} is not {n} finite numbers")
    return [float(v) for v in values]


def rfc010_row(rec: dict, vocab_size: int, include_scaffold: bool) -> EchoRow:
    ids = _ids(rec.get("input_ids"), vocab_size, "input_ids")
    n = len(ids)
    masks = {key: _mask(rec, key, n) for key in ("action_mask", "obs_mask", "warning_mask")}
    scaffold = _mask(rec.get("quaero") or {}, "scaffold_mask", n)
    kinds = []
    for i in range(n):
        on = [k for k, m in (("action", masks["action_mask"]), ("env", masks["obs_mask"]),
                             ("corrective", masks["warning_mask"]), ("scaffold", scaffold)) if m[i]]
        if len(on) > 1:
            raise TraceRefused(f"token {i} is marked {' and '.join(on)}: the role masks must be disjoint")
        kinds.append(on[0] if on else "prompt")
    if "action" not in kinds and "env" not in kinds:
        raise TraceRefused("no action or obs token: nothing to train")
    quaero = rec.get("quaero") if isinstance(rec.get("quaero"), dict) else {}
    return _row_from_kinds(ids, kinds, _logprobs(rec.get("logprobs"), n, "logprobs"),
                           include_scaffold=include_scaffold,
                           meta={"source": "rfc010", **_rl_fields({**quaero, **rec})})


def trace_row(rec: dict, vocab_size: int, include_scaffold: bool) -> EchoRow:
    from openenv.core.harness.training import TrainingTrace
    from pydantic import ValidationError

    try:
        trace = TrainingTrace.model_validate(rec)
    except ValidationError as e:
        raise TraceRefused(f"not a valid OpenEnv TrainingTrace ({e.errors()[0]['msg']})") from None
    if not trace.turns:
        raise TraceRefused("a TrainingTrace without turns")
    ids: list[int] = []
    kinds: list[str] = []
    logprobs: list[float] = []
    for k, turn in enumerate(trace.turns):
        prompt = _ids(turn.prompt_token_ids, vocab_size, f"turn {k} prompt_token_ids")
        if prompt[:len(ids)] != ids:
            raise TraceRefused(f"turn {k}'s prompt is not an extension of turn {k - 1}'s prompt + "
                               "completion: its tokens are not the ones the model saw in one sequence")
        suffix = len(prompt) - len(ids)
        kinds += ["prompt" if k == 0 else "env"] * suffix
        completion = _ids(turn.completion_token_ids, vocab_size, f"turn {k} completion_token_ids")
        mask = turn.loss_mask[len(prompt):]
        kinds += ["action" if m else "prompt" for m in mask]
        logprobs += [0.0] * suffix + list(turn.per_token_logps)
        ids = prompt + completion
    quaero = trace.turns[-1].metadata.get("quaero")
    if isinstance(quaero, dict) and "roles" in quaero:
        ids = ids + _ids(quaero.get("tail_token_ids", []), vocab_size, "tail_token_ids")
        logprobs += [0.0] * (len(ids) - len(logprobs))
        roles = _expand(quaero["roles"], "quaero roles")
        if len(roles) != len(ids):
            raise TraceRefused(f"quaero roles cover {len(roles)} tokens, the turns hold {len(ids)}")
        if [r == "action" for r in roles[:len(kinds)]] != [k == "action" for k in kinds]:
            raise TraceRefused("quaero roles disagree with the turns' loss_mask about which tokens are "
                               "actions")
        kinds = roles
    last = trace.turns[-1].metadata
    fields = {**last, **quaero} if isinstance(quaero, dict) else dict(last)
    return _row_from_kinds(ids, kinds, logprobs, include_scaffold=include_scaffold,
                           meta={"source": "openenv-trace", "node_id": trace.turns[-1].node_id,
                                 **_rl_fields(fields)})


def load_traces(path: str | Path, vocab_size: int, *, include_scaffold: bool = False,
                max_len: int | None = None, loss: str = "sft") -> tuple[list[EchoRow], list[str]]:
    """Rows rebuilt from a file of RFC 010 records and/or TrainingTraces, and one reason per refused line
    ("path:LINE: reason"). OSError when the file cannot be read. loss="rl" ([data] traces_loss): each row also
    gets the advantage the RL loss reads (`rl_rows`), and a record that cannot have one is refused."""
    rows, refused, lines = [], [], []
    with Path(path).open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                try:
                    rec = json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, ValueError, RecursionError):
                    raise TraceRefused("not a UTF-8 JSON object") from None
                if isinstance(rec, dict) and "turns" in rec:
                    rows.append(trace_row(rec, vocab_size, include_scaffold))
                elif isinstance(rec, dict) and "input_ids" in rec:
                    rows.append(rfc010_row(rec, vocab_size, include_scaffold))
                else:
                    raise TraceRefused("neither an RFC 010 record (input_ids + masks) nor a TrainingTrace "
                                       "(turns)")
                if max_len is not None and len(rows[-1]) > max_len:
                    rows.pop()
                    raise TraceRefused(f"longer than [model] max_seq_len={max_len}")
                lines.append(number)
            except (TraceRefused, RowError) as e:
                refused.append(f"{path}:{number}: {e}")
    if loss == "rl":
        rows, rl_refused = rl_rows(rows, [f"{path}:{n}" for n in lines])
        refused += rl_refused
    return rows, refused


# ── off-policy RL on recorded rows ([data] traces_loss = "rl") ──────────────────────────────────


def _finite(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def _rl_fields(fields: dict) -> dict:
    """What a record says for the RL loss: its `advantage`, its `reward` and its `group` (the records of one
    task sampled together, whose rewards give group-relative advantages), where it says them."""
    out = {k: fields[k] for k in ("advantage", "reward") if k in fields}
    if isinstance(fields.get("group"), (str, int)) and not isinstance(fields.get("group"), bool):
        out["group"] = str(fields["group"])
    return out


def rl_rows(rows: list[EchoRow], where: list[str]) -> tuple[list[EchoRow], list[str]]:
    """Rows for the off-policy RL loss: each with its advantage on its action tokens (the record's own
    `advantage`, else its reward minus its group's mean reward, as quaero's rollouts do) and the recorded
    sampler log-probs it already holds (the importance ratio's denominator). Refused in one line each
    (where[i]: reason): a row whose action tokens carry no sampler log-prob (all 0.0: an oracle demo, or a
    record without `logprobs`) or a positive one; one with no advantage and no reward with a group; an
    advantage past MAX_ABS_ADVANTAGE (recorded, or from its group's rewards); a group of one record."""

    refused: list[str] = []
    ready: list[tuple[int, float]] = []
    groups: dict[str, list[tuple[int, float]]] = {}
    for i, row in enumerate(rows):
        action = [lp for lp, m in zip(row.sampler_logprobs, row.action_mask) if m]
        advantage, reward, group = _finite(row.meta.get("advantage")), _finite(row.meta.get("reward")), \
            row.meta.get("group")
        if not action or all(lp == 0.0 for lp in action):
            refused.append(f"{where[i]}: its action tokens carry no sampler log-probs (all 0.0: an oracle "
                           "demo, or no `logprobs`/`per_token_logps`), so the RL loss has no importance "
                           "ratio; train it with "
                           '[data] traces_loss = "sft"')
        elif any(lp > 0.0 for lp in action):
            refused.append(f"{where[i]}: a sampler log-prob above 0 on an action token: not a "
                           "log-probability")
        elif (bad := next((k for k in ("advantage", "reward") if row.meta.get(k) is not None
                           and _finite(row.meta.get(k)) is None), None)):
            refused.append(f"{where[i]}: its {bad} {row.meta[bad]!r} is not a finite number")
        elif advantage is not None and abs(advantage) > MAX_ABS_ADVANTAGE:
            refused.append(f"{where[i]}: its advantage {advantage:g} is past +-{MAX_ABS_ADVANTAGE:g}, more "
                           "than the fp32 loss holds (it would train nothing: a NaN loss); scale the "
                           "record's advantages")
        elif advantage is not None:
            ready.append((i, advantage))
        elif reward is not None and group is not None:
            groups.setdefault(group, []).append((i, reward))
        else:
            refused.append(f"{where[i]}: no `advantage`, and no `reward` with a `group` (the records of one "
                           "task sampled together): nothing for the RL loss to weigh its actions by")
    for group, members in groups.items():
        if len(members) < 2:
            refused.append(f"{where[members[0][0]]}: the only record of group {group!r}: a group-relative "
                           "advantage needs two or more")
            continue
        ready += zip([i for i, _ in members], group_advantages([r for _, r in members]))
    out = []
    for i, advantage in sorted(ready):
        if not math.isfinite(advantage):
            refused.append(f"{where[i]}: its group's rewards give no finite advantage")
            continue
        row = rows[i]
        out.append(row.with_advantage(advantage, episode=row.meta.get("group") or where[i]))
    return out, refused



# ── the warm start (quaero/recipe/train.py) ────────────────────────────────────────────────────────────


def vocab_size_of(model_name: str) -> int:
    """The ids a row may hold: the model's embedding rows (a sampler may return any of them, also ids past the
    tokenizer's last token), at least the tokenizer's length."""
    from quaero.models.load import load_tokenizer, resolve_model

    n = len(load_tokenizer(model_name))
    try:
        config = json.loads((resolve_model(model_name) / "config.json").read_text())
    except (OSError, ValueError):
        return n
    return max(n, int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0))


def warm_start_rows(cfg: Any, source: str = "config") -> tuple[list[EchoRow], list[str]]:
    """`[data] traces` read for training: (rows, refusals), each refusal logged in one line; a ConfigError
    when the file cannot be read or holds no exact record."""
    return read_traces(cfg, cfg.data.traces, "[data] traces", source, loss=cfg.data.traces_loss)


def read_traces(cfg: Any, path: str, key: str, source: str = "config", loss: str = "sft"
                ) -> tuple[list[EchoRow], list[str]]:
    """The trace file `path` (config key `key`: `[data] traces`, `[guidance] traces`) read into rows:
    (rows, refusals), each refusal logged in one line; a ConfigError when it cannot be read or holds no
    exact record."""
    vocab_size = vocab_size_of(cfg.model.name)
    if Path(path).exists() and not Path(path).is_file():  # a FIFO would block the read until a writer came
        raise ConfigError(f"{source} {key}={path!r}: not a regular file (a FIFO, a device or a "
                          "folder); name a .jsonl file of records")
    try:
        rows, refused = load_traces(path, vocab_size, include_scaffold=cfg.echo.include_scaffold,
                                    max_len=cfg.model.max_seq_len, loss=loss)
    except OSError as e:
        raise ConfigError(f"{source} {key}={path!r}: cannot read it ({e.strerror or e})") from None
    for reason in refused:
        log.warning(names.TRACE_RECORD_REFUSED_EVENT, reason=reason)
    if not rows:
        raise ConfigError(f"{source} {key}={path!r}: no exact record in it ({len(refused)} refused"
                          + (f"; first: {refused[0]}" if refused else "") + "); write it with `quaero "
                          "inspect rows RUN --export rfc010|openenv-trace OUT.jsonl` or OpenEnv's capture")
    log.info(names.TRACES_LOADED_EVENT, path=str(path), key=key, rows=len(rows), records_refused=len(refused))
    return rows, refused


def trace_line(cfg: Any, source: str = "config") -> str:
    """`quaero check`'s data line."""
    rows, refused = warm_start_rows(cfg, source)
    t = cfg.training
    loss = ("off-policy RL (importance ratio over the recorded log-probs) + ECHO"
            if cfg.data.traces_loss == "rl"
            else "SFT + ECHO")
    return (f"data        traces {cfg.data.traces}: {len(rows)} exact rows, trained as {t.warmup_sft_steps} "
            f"{loss} warm-start steps of {cfg.rollout.tasks_per_step} rows; {len(refused)} line(s) refused"
            + (f" (first: {refused[0]})" if refused else ""))


def guide_trace_line(cfg: Any, source: str = "config") -> str:
    """`quaero check`'s line for recorded episodes as the guide (`[guidance] traces`)."""
    path = cfg.guidance.traces
    rows, refused = read_traces(cfg, path, "[guidance] traces", source)
    guide = RecordedActions(rows)
    return (f"guide       traces {path}: {len(rows)} exact rows, {len(guide)} recorded actions replayed "
            f"where a live prompt equals a recording's; {len(refused)} line(s) refused"
            + (f" (first: {refused[0]})" if refused else ""))


def trace_batch(rows: list[EchoRow], step: int, per_step: int, share: list[int]) -> list[EchoRow]:
    """Warm-start step `step`'s rows (this rank's `share` of its `per_step`), cycling through the file in
    order: a function of the step alone, so a resumed run trains the same rows."""
    return [rows[((step - 1) * per_step + i) % len(rows)] for i in share]


# ── recorded episodes as guides ([guidance] traces) ──────────────────────────────────────────


def _prompt_key(ids: list[int]) -> bytes:
    return array("q", ids).tobytes()


class RecordedActions:
    """Recorded episodes replayed as a guide (`[guidance] traces`, quaero/recipe/guidance.py): every
    action span of every row, keyed by the exact ids before it (the prompt its model was given), so a live
    episode whose prompt is one of them gets the recorded action ids verbatim. A prompt the recordings never
    reached (a task not recorded, an env that answered otherwise than in the recording, another template)
    has no action: `action` answers None, and the driver drops that guided member, counted. Where several
    recordings share a prompt, the one of the higher finite reward plays (the first such in the file)."""

    def __init__(self, rows: list[EchoRow]):
        self._actions: dict[bytes, tuple[float, list[int]]] = {}
        self.episodes = len(rows)
        for row in rows:
            reward = _finite(row.meta.get("reward"))
            rank = -math.inf if reward is None else reward
            for s in row.spans:
                if s.kind != "action":
                    continue
                key = _prompt_key(row.input_ids[:s.start])
                if key not in self._actions or rank > self._actions[key][0]:
                    self._actions[key] = (rank, row.input_ids[s.start:s.end])

    def __len__(self) -> int:
        return len(self._actions)

    def action(self, prompt_ids: list[int]) -> list[int] | None:
        """The recorded action ids after exactly `prompt_ids`, or None."""
        found = self._actions.get(_prompt_key(prompt_ids))
        return None if found is None else list(found[1])
