"""`resolve_name`: the one reader of `"package.module:attr"` names, and its one error line.

Every name a config, a flag or a registry gives as "package.module:attr" is read here: env entries,
actions and formatters (`[env]`), the warm start's oracle (`[training] oracle`), scripted policies (`quaero
eval --model`), env launchers (quaero/launcher_registry.py), sampler engines (quaero/sampler_registry.py) and
trainers (trainers/registry.py). A name that does not resolve is one line, `KEY=VALUE: what was missing; the
fix`, where what was missing is one of:

- the shape: `expected 'package.module:Name' (a colon before the name)`
- the module: `cannot import module 'm' (...)`, or `importing 'm' raised X: ...` (its own setup failed)
- the attribute: `module 'm' has no attribute 'a'`
- its kind: `'a' is a T, not W` (not callable, not a class of the kind the key takes)

The error is the caller's class (a `ConfigError` for a config key, an `EvalError` for a flag), `Unresolved`
where the caller names none.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from quaero.telemetry.runlog import error_line


class Unresolved(ValueError):
    """A "package.module:attr" name that does not resolve, in `resolve_name`'s one line."""


def split_name(value: str, key: str, *, error: Callable[[str], Exception] = Unresolved,
               example: str = "envs.toolbench:ToolBenchEnv") -> tuple[str, str]:
    """(module, attr) of `value`, judged by its shape alone (nothing imported): a config judges it on load."""
    module_name, colon, attr = value.partition(":")
    if not colon or not module_name or not attr:
        raise error(f"{key}={value!r}: expected 'package.module:Name' (a colon before the name), "
                    f"e.g. {example!r}")
    return module_name, attr


def resolve_name(value: str, key: str, *, want: Callable[[Any], bool] | None = None, wanted: str = "",
            fix: str | Callable[[ModuleType], str] = "", error: Callable[[str], Exception] = Unresolved,
            example: str = "envs.toolbench:ToolBenchEnv") -> Any:
    """The object `value` ("package.module:attr", attr may be dotted) names, for the setting `key`.

    want: the kind check the object must pass (`callable`, `inspect.isclass`, ...), `wanted` its words ("a
    function (observation: dict) -> str"); fix: what the user can do, appended to an attribute or kind
    failure (a function of the imported module for a fix that reads it: the classes it does hold); error: the
    exception class raised (its message is the one line)."""
    head = f"{key}={value!r}"
    module_name, attr = split_name(value, key, error=error, example=example)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise error(f"{head}: cannot import module {module_name!r} ({e}); make sure its package is "
                    "installed or on PYTHONPATH") from None
    except Exception as e:  # noqa: BLE001 - the module's own code failed on import (a dataset it loads is missing)
        raise error(f"{head}: importing {module_name!r} raised {error_line(e)}; the module's own setup "
                    "failed (a dataset, file or setting it needs?): fix that, then try again") from None

    def fail(missing: str) -> Exception:
        said = fix(module) if callable(fix) else fix  # only on failure: a fix may read the module
        return error(f"{head}: {missing}" + (f"; {said}" if said else ""))

    obj: Any = module
    parts = attr.split(".")
    for i, part in enumerate(parts):
        if not hasattr(obj, part):
            where = f"module {module_name!r}" if i == 0 else repr(".".join(parts[:i]))
            raise fail(f"{where} has no attribute {part!r}")
        obj = getattr(obj, part)
    if want is not None and not want(obj):
        kind = "class" if isinstance(obj, type) else type(obj).__name__
        raise fail(f"{attr!r} is a {kind}, not {wanted or 'what ' + key + ' takes'}")
    return obj
