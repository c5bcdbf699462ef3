"""Reading a config: the TOML file, `--set` overrides, old spellings rewritten (quaero/config/renamed.py),
one error line per problem (the file, the section, the key, the value, the closest valid key;
quaero/config/errors.py) and the rules across sections (quaero/config/rules.py).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
from quaero.config.base import ConfigError
from quaero.config.errors import format_error
from quaero.config.renamed import migrate
from quaero.config.rules import check_rules
from quaero.config.schema import QuaeroConfig


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], parsed value); the value is read as TOML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set training.steps=3")
    path, raw = text.split("=", 1)
    if not path.strip() or any(not part.strip() for part in path.split(".")):
        raise ConfigError(f"--set {text!r}: the key is empty; expected section.key=value, e.g. --set "
                          "training.steps=3")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # a bare word is a string: --set run.name=smoke
    except RecursionError:
        raise ConfigError(f"--set {path.strip()}=...: the value nests too deeply to read; a setting nests a "
                          "few levels at most") from None
    return path.strip().split("."), value


def load_config(path: str | Path, overrides: list[str] = ()) -> QuaeroConfig:
    """Read, override and validate a config. Raises ConfigError with a one-line, user-facing message."""
    path = Path(path)
    source = str(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{source}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{source}: is a folder; pass a TOML file, e.g. envs/toolbench.toml") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text (byte {e.start}); save the config as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{source}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{source}: nests arrays or tables too deeply to read; a config nests a few levels "
                          "at most") from None
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for k in keys[:-1]:
            if isinstance(node, list):  # [[envs]]: --set envs.NAME.key=value picks the env named NAME
                named = [e for e in node if isinstance(e, dict) and e.get("name") == k]
                if not named:
                    raise ConfigError(f"--set {text!r}: no [[envs]] entry is named {k!r}; write "
                                      "envs.NAME.key=value with one of the mixture's names")
                node = named[0]
                continue
            node = node.setdefault(k, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"--set {text!r}: {k!r} is not a section")
        if isinstance(node, list):
            raise ConfigError(f"--set {text!r}: [[envs]] holds several envs; write envs.NAME.key=value")
        node[keys[-1]] = value
    deprecated = migrate(data, source)
    try:
        cfg = QuaeroConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_error(source, data, e.errors()[0])) from None
    except RecursionError:
        raise ConfigError(f"{source}: a value nests too deeply to check; a config nests a few levels at "
                          "most") from None
    check_rules(cfg, source)
    cfg._deprecated = deprecated
    return cfg
