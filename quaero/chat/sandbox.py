"""Chat templates are untrusted code: compiled once in jinja2's `ImmutableSandboxedEnvironment`, set up as
transformers sets it up for `apply_chat_template` (trim_blocks, lstrip_blocks, loop controls, its `tojson`,
`raise_exception`, `strftime_now`, the `{% generation %}` tag), so a render is the template's own render;
and rendered with a bound on its output, so a template that loops forever printing stops at the bound.

`strftime_now` reads a clock fixed when the template is compiled (`TemplateRunner(now=...)`), so a template
that prints today's date (Llama 3.x) renders the same text all run long instead of changing at midnight.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

# A chat render is a conversation's text; this is far above any context quaero trains on (about 64 MiB).
MAX_RENDER_CHARS = 1 << 26


class TemplateProblem(ValueError):
    """A chat template that does not compile, raises, or renders past the output bound; the message is one
    line: what failed, in the template's words."""


def _environment(now: datetime):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders its body."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = now.strftime
    return env


class TemplateRunner:
    """One compiled chat template: `render(**variables) -> str` and the variables it reads."""

    def __init__(self, source: str, *, now: datetime | None = None, max_chars: int = MAX_RENDER_CHARS):
        import jinja2
        from jinja2 import meta

        self.source = source
        self.max_chars = max_chars
        env = _environment(now or datetime.now())
        try:
            self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateProblem(f"the chat template does not compile ({type(e).__name__}: {e})") from None

    def render(self, **variables: Any) -> str:
        """The template's text; raises TemplateProblem on any error inside it or past `max_chars`."""
        out: list[str] = []
        size = 0
        try:
            for block in self._template.generate(**variables):
                size += len(block)
                if size > self.max_chars:
                    raise TemplateProblem(f"the chat template rendered more than {self.max_chars:,} "
                                          "characters")
                out.append(block)
        except TemplateProblem:
            raise
        except Exception as e:  # noqa: BLE001 - whatever the template raised (its own raise_exception included)
            raise TemplateProblem(f"the chat template raised {type(e).__name__}: {str(e)[:200]}") from None
        return "".join(out)
