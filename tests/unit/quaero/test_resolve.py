"""quaero/resolve.py: every "package.module:attr" name resolves through one function, and each way it can fail
is one line of one shape: KEY=VALUE, what was missing, the fix."""
import inspect

import pytest

from quaero.config import ConfigError
from quaero.resolve import Unresolved, resolve_name, split_name


def test_a_name_resolves_to_its_object_dotted_attributes_too():
    import json

    assert resolve_name("json:loads", "[k] v") is json.loads
    assert resolve_name("json:JSONDecoder.decode", "[k] v") is json.JSONDecoder.decode
    assert split_name("a.b:c", "[k] v") == ("a.b", "c")


SHAPE = "expected 'package.module:Name' (a colon before the name), e.g. 'envs.toolbench:ToolBenchEnv'"


@pytest.mark.hostile
@pytest.mark.parametrize("value,missing", [
    ("json", SHAPE),
    (":loads", SHAPE),
    ("json:", SHAPE),
    ("no_such_pkg_q.mod:X",
     ("cannot import module 'no_such_pkg_q.mod' (No module named 'no_such_pkg_q'); make sure its package is "
     "installed or on PYTHONPATH")),
    ("fixtures.broken_import:Env",
     ("importing 'fixtures.broken_import' raised FileNotFoundError: [Errno 2] No such file or directory: "
     "'dataset/dipg.jsonl'; the module's own setup failed (a dataset, file or setting it needs?): fix that, "
     "then try again")),
    ("json:nope", "module 'json' has no attribute 'nope'"),
    ("json:JSONDecoder.nope", "'JSONDecoder' has no attribute 'nope'"),
])
def test_each_failure_is_one_line_naming_the_key_the_value_and_what_was_missing(value, missing):
    with pytest.raises(ConfigError) as e:
        resolve_name(value, "[env] entry", error=ConfigError)
    assert str(e.value) == f"[env] entry={value!r}: {missing}"


@pytest.mark.hostile
def test_a_wrong_kind_says_what_it_is_and_what_the_key_takes_with_the_fix():
    with pytest.raises(Unresolved) as e:
        resolve_name("json:__version__", "[env] formatter", want=callable, wanted="a function",
                     fix="name one")
    assert str(e.value) == ("[env] formatter='json:__version__': '__version__' is a str, not a function; "
                            "name one")
    with pytest.raises(Unresolved) as e:
        resolve_name("os:system", "--model", want=inspect.isfunction, wanted="a Python function")
    assert str(e.value) == ("--model='os:system': 'system' is a builtin_function_or_method, not a Python "
                            "function")
    with pytest.raises(Unresolved) as e:
        resolve_name("json:JSONDecoder", "[k] v", want=inspect.isfunction)
    assert str(e.value) == "[k] v='json:JSONDecoder': 'JSONDecoder' is a class, not what [k] v takes"


@pytest.mark.hostile
def test_a_fix_that_reads_the_module_runs_only_on_failure():
    read = []

    def fix(module):
        read.append(module.__name__)
        return f"names there: {sorted(n for n in vars(module) if n.startswith('load'))}"

    resolve_name("json:loads", "[k] v", fix=fix)
    assert read == []
    with pytest.raises(Unresolved) as e:
        resolve_name("json:lods", "[k] v", fix=fix)
    assert str(e.value) == ("[k] v='json:lods': module 'json' has no attribute 'lods'; "
                            "names there: ['load', 'loads']")


def test_the_registries_resolve_through_it():
    from quaero import launcher_registry, sampler_registry
    from trainers import registry

    assert callable(launcher_registry.opener("remote")) and callable(sampler_registry.builder("hf"))
    assert registry.trainer_class("local").__name__ == "LocalTrainer"
