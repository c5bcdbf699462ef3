"""A pydantic validation error as the user's one line: the file, the section, the key, the value, and the
closest valid key for an unknown one."""
from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel

from quaero.config.base import Located
from quaero.config.loss import VARIANTS
from quaero.config.schema import QuaeroConfig


def _closest(key: str, model: type[BaseModel]) -> str:
    match = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(model.model_fields)}"


def _section_model(loc: tuple, data: dict) -> type[BaseModel]:
    if loc == ("loss", "policy"):  # the variant's section, by its type
        return VARIANTS.get(str(_lookup(data, (*loc, "type"))), QuaeroConfig)
    model: type[BaseModel] = QuaeroConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            break
    return model


def _lookup(data: dict, loc: tuple) -> Any:
    node: Any = data
    for part in loc:
        if (
            isinstance(node, dict)
            and part in node
            or isinstance(node, list)
            and isinstance(part, int)
            and 0 <= part < len(node)
        ):
            node = node[part]
        else:
            return None
    return node


def format_error(source: str, data: dict, err: dict) -> str:
    if err["loc"][:1] == ("envs",) and len(err["loc"]) > 1 and isinstance(err["loc"][1], int):  # which env
        env = _lookup(data, ("envs",))
        env = env[err["loc"][1]] if isinstance(env, list) and len(env) > err["loc"][1] else {}
        name = env.get("name") if isinstance(env, dict) else None
        source = f"{source} [[envs]] #{err['loc'][1] + 1}" + (f" name={name!r}" if name else "")
    if err["loc"][:2] == ("loss", "policy") and len(err["loc"]) > 2 and err["loc"][2] in VARIANTS:
        err = {**err, "loc": err["loc"][:2] + err["loc"][3:]}  # the variant's tag is no key of the TOML
    if err["type"] == "union_tag_invalid":  # [loss.policy] type names no variant
        err = {**err, "loc": (*err["loc"], "type"), "msg": f"use one of {err['ctx']['expected_tags']}"}
    loc = tuple(p for p in err["loc"] if not isinstance(p, int))
    section = ".".join(str(p) for p in loc[:-1]) or "(top level)"
    key = str(loc[-1]) if loc else "?"
    value = _lookup(data, tuple(err["loc"]))
    where = f"{source} [{section}] {key}"
    if err["type"] == "extra_forbidden":
        return f"{where}: unknown key{_closest(key, _section_model(loc[:-1], data))}"
    if err["type"] == "missing":
        return f"{where}: required section/key is missing"
    msg = err["msg"]
    if err["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
        if isinstance(err.get("ctx", {}).get("error"), Located):  # a section's rule names its own keys
            return f"{source} [{'.'.join(str(p) for p in loc)}] {msg}"
        return f"{source} [{'.'.join(str(p) for p in loc) or 'config'}]: {msg}"
    return f"{where}={_brief(value)}: {msg}"


def _brief(value: Any, limit: int = 200) -> str:
    """`repr(value)`, cut to `limit` characters: an error line stays one readable line whatever was pasted
    in."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
