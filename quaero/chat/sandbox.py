"""Chat templates are untrusted code: compiled once in jinja2's `ImmutableSandboxedEnvironment`, set up as
transformers sets it up for `apply_chat_template` (trim_blocks, lstrip_blocks, loop controls, its `tojson`,
`raise_exception`, `strftime_now`, the `{% generation %}` tag), so a render is the template's own render;
and rendered with a bound on its output, so a template that loops forever printing stops at the bound.

The sandbox keeps a template from Python's internals, files and processes, not from memory or time: `'x' *
10**10`, `'x'|center(10**10)`, `'{:>10000000000}'.format(1)`, a string doubled in a loop (`~`, `+`, `join`,
`replace`) or `9 ** 10**9` would each allocate or compute without end before the output bound is reached. So
every step that can grow a value is bounded before it runs (`_Guard`: an operator's result, a number passed
to a call or filter, a format width, a concatenation, an int's size) and every call's and filter's result
after; and a render runs on a worker thread for at most `MAX_RENDER_S` (nested loops that print nothing).
What C code does holding the GIL no time bound can stop, so it is bounded by size before it runs: every
list, tuple and dict a template builds (a literal, an operator's, a call's or a filter's result) is refused
when it would print past the output bound, parts shared by reference counted each time (`[x, x]` doubled 40
times holds two items and prints 2**40), and `strftime_now`'s format is short.

`strftime_now` reads a clock fixed when the template is compiled (`TemplateRunner(now=...)`), so a template
that prints today's date (Llama 3.x) renders the same text all run long instead of changing at midnight.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

from quaero.bounded import CallTimeout, CallWorker, bounded_call

# A chat render is a conversation's text; this is far above any context quaero trains on (about 64 MiB).
MAX_RENDER_CHARS = 1 << 26
MAX_RENDER_S = 10.0  # one render's wall time (a real one takes milliseconds)
MAX_INT_BITS = 1 << 16  # an int a template computes (about 20,000 digits)
MAX_ITEMS = 1 << 20  # a list, tuple or dict a template builds (its range() is capped at 100,000)
MAX_STRFTIME_CHARS = 1000  # a date format (Llama 3's is "%d %b %Y")
_HUGE_WIDTH = re.compile(r"\d{9,}")  # a format width of 100,000,000 or more: past any render


class _Guard:
    """The bounds of one environment: each check raises jinja2's SecurityError naming what was refused."""

    def __init__(self, max_chars: int) -> None:
        from jinja2.utils import Namespace

        self.max_chars, self._namespace = max_chars, Namespace
        # each container's printed size, by id (the container held so its id stays its own), for one render
        self._sizes: dict[int, tuple[Any, int]] = {}

    def reset(self) -> None:
        self._sizes.clear()

    def printed(self, value: Any, walking: set[int] | None = None) -> int:
        """About how many characters `value` prints as (`{{ x }}`, `|string`, `|tojson`, `|join`), a part
        shared by reference counted each time it appears: a list doubled by reference 40 times holds two
        items yet prints 2**40 of them, in C code that holds the GIL (no time bound could stop it). Memoized
        per container, the walk stops past the bound; a cycle prints as `[...]`."""
        if isinstance(value, (str, bytes)):
            return len(value)
        spaced = isinstance(value, self._namespace)  # its attributes change: walked each time
        if isinstance(value, (int, float)) or value is None:
            return len(repr(value))  # an int has at most MAX_INT_BITS
        if not (spaced or isinstance(value, (list, tuple, dict, set, frozenset))):
            return 24  # an object: its repr
        if len(value if not spaced else object.__getattribute__(value, "_Namespace__attrs")) > MAX_ITEMS:
            return self.max_chars + 1  # no chat render holds so many: refused before a walk over them
        key, walking = id(value), walking if walking is not None else set()
        if (hit := self._sizes.get(key)) is not None and hit[0] is value:
            return hit[1]
        if key in walking:
            return 5
        walking.add(key)
        items = object.__getattribute__(value, "_Namespace__attrs") if spaced else value
        parts = (p for kv in items.items() for p in kv) if isinstance(items, dict) else iter(items)
        total = 2
        for part in parts:
            kind = type(part)  # the common leaves inline: a list of a million ints is walked in a blink
            total += 2 + (len(part) if kind is str else len(repr(part)) if kind is int or kind is float
                          else self.printed(part, walking))
            if total > self.max_chars:
                break
        walking.discard(key)
        if not spaced:
            self._sizes[key] = (value, total)
        return total

    def built(self, value: Any, what: str = "a list, tuple or dict literal") -> Any:
        """A container the template built, refused when it would print past the bound."""
        if (n := self.printed(value)) > self.max_chars:
            self.refuse(f"{what} would print as {n:,}+ characters")
        return value

    def refuse(self, what: str, bound: str | None = None) -> None:
        from jinja2.sandbox import SecurityError

        raise SecurityError(f"{what}: past the bound of {bound or f'{self.max_chars:,} characters'}")

    def size(self, value: Any, what: str) -> Any:
        if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > self.max_chars:
            self.refuse(f"{what} made {len(value):,} items")
        if isinstance(value, (list, tuple, dict, set, frozenset)):
            self.built(value, what)
        if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
            self.refuse(f"{what} made an int of {value.bit_length():,} bits", f"{MAX_INT_BITS:,} bits")
        return value

    def binop(self, op: str, left: Any, right: Any) -> None:
        seqs = (str, bytes, list, tuple)
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, seqs) and isinstance(n, int) and self.printed(seq) * n > self.max_chars:
                    self.refuse(f"'*' would make {self.printed(seq) * n:,} characters")
            if isinstance(left, int) and isinstance(right, int) and (
                    left.bit_length() + right.bit_length() > MAX_INT_BITS):
                self.refuse("'*' would make an int too large", f"{MAX_INT_BITS:,} bits")
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and (
                right * left.bit_length() > MAX_INT_BITS):
            self.refuse(f"'**' would make an int of about {right * left.bit_length():,} bits",
                        f"{MAX_INT_BITS:,} bits")
        elif op == "+" and isinstance(left, seqs) and isinstance(right, seqs) and (
                self.printed(left) + self.printed(right) > self.max_chars):
            self.refuse(f"'+' would make {self.printed(left) + self.printed(right):,} characters")
        elif op == "%" and isinstance(left, str) and _HUGE_WIDTH.search(left):
            self.refuse(f"'%' with a format width of {_HUGE_WIDTH.search(left).group()}")

    def call(self, obj: Any, args: tuple, kwargs: dict, what: str) -> None:
        """Before a call or filter: no number past the bound, no huge format width, no `replace` that would
        grow past it."""
        values = [*args, *kwargs.values()]
        counts = getattr(obj, "__name__", "") != "safe_range"  # range has the sandbox's own bound, MAX_RANGE
        for v in values if counts else ():
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > self.max_chars:
                self.refuse(f"{what} called with {v:,}")
        fmt = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
        if isinstance(fmt, str) and (m := _HUGE_WIDTH.search(fmt)):
            self.refuse(f"{what} with a format width of {m.group()}")
        texts = [fmt] if isinstance(fmt, str) else []
        texts += [v for v in values if isinstance(v, str)]
        if getattr(obj, "__name__", "") in ("replace", "do_replace") and len(texts) >= 3:
            text, old, new = texts[:3]
            count = text.count(old) if old else len(text) + 1
            if len(text) + count * (len(new) - len(old)) > self.max_chars:
                self.refuse(f"{what} would make {len(text) + count * (len(new) - len(old)):,} characters")

    def concat(self, parts: tuple) -> str:
        texts = [str(p) for p in parts]
        if sum(map(len, texts)) > self.max_chars:
            self.refuse(f"'~' would make {sum(map(len, texts)):,} characters")
        return "".join(texts)


class TemplateProblem(ValueError):
    """A chat template that does not compile, raises, or renders past the output bound; the message is one
    line: what failed, in the template's words."""


def _generation_extension():
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders its body."""
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _bounded_code_generator():
    """jinja2's code generator with what builds a value routed through the environment's guard."""
    from jinja2.compiler import CodeGenerator

    class BoundedConcat(CodeGenerator):
        """`a ~ b` through the guard (jinja2 joins it inline, where no sandbox hook sees it)."""

        def visit_Concat(self, node, frame) -> None:
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

        def _built(self, visit, node, frame) -> None:
            """A list, tuple or dict literal through the guard (`[x, x]` builds without a hook); a tuple
            that is assigned to (`{% for a, b in ... %}`) is a target, not a value."""
            if getattr(node, "ctx", "load") != "load":
                return visit(node, frame)
            self.write("environment.bounded_value(")
            visit(node, frame)
            self.write(")")

        def visit_List(self, node, frame) -> None:
            self._built(super().visit_List, node, frame)

        def visit_Tuple(self, node, frame) -> None:
            self._built(super().visit_Tuple, node, frame)

        def visit_Dict(self, node, frame) -> None:
            self._built(super().visit_Dict, node, frame)

    return BoundedConcat


def _environment(now: datetime, max_chars: int = MAX_RENDER_CHARS):
    import functools

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    guard = _Guard(max_chars)

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})
        code_generator_class = _bounded_code_generator()

        def call_binop(self, context, operator, left, right):
            guard.binop(operator, left, right)
            return guard.size(super().call_binop(context, operator, left, right), f"'{operator}'")

        def call(self, context, obj, /, *args, **kwargs):
            what = getattr(obj, "__name__", type(obj).__name__)
            guard.call(obj, args, kwargs, what)
            return guard.size(super().call(context, obj, *args, **kwargs), what)

        def bounded_concat(self, parts: tuple) -> str:
            return guard.concat(parts)

        def bounded_value(self, value: Any) -> Any:
            return guard.built(value)

    def bounded_filter(name: str, f):
        @functools.wraps(f)  # keeps jinja2's pass_context / pass_eval_context marks
        def run(*args, **kwargs):
            guard.call(f, args, kwargs, f"filter {name!r}")
            return guard.size(f(*args, **kwargs), f"filter {name!r}")

        return run

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception

    def strftime_now(fmt: str) -> str:
        # strftime runs in C holding the GIL: '%c' * 30,000,000 took 84 s and 4.4 GB
        if len(str(fmt)) > MAX_STRFTIME_CHARS:
            guard.refuse(f"strftime_now with a format of {len(str(fmt)):,} characters",
                         f"{MAX_STRFTIME_CHARS:,} characters")
        return now.strftime(fmt)

    env.globals["strftime_now"] = strftime_now
    env.guard = guard
    return env


class TemplateRunner:
    """One compiled chat template: `render(**variables) -> str` and the variables it reads."""

    def __init__(self, source: str, *, now: datetime | None = None, max_chars: int = MAX_RENDER_CHARS,
                 max_seconds: float = MAX_RENDER_S):
        import jinja2
        from jinja2 import meta

        self.source = source
        self.max_chars, self.max_seconds = max_chars, max_seconds
        self._worker = CallWorker("quaero-chat-template")
        env = _environment(now or datetime.now(), max_chars)
        self._guard = env.guard
        try:
            self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateProblem(f"the chat template does not compile ({type(e).__name__}: {e})") from None
        except (RecursionError, SyntaxError, MemoryError) as e:  # its parser recurses per nesting level and
            # Python compiles at most 20 nested blocks, 100 indents: a 3,000-deep `{% if %}` nest
            raise TemplateProblem(f"the chat template nests too deep to compile ({type(e).__name__}; a "
                                  "template compiles at most about 20 nested blocks); flatten it") from None

    def render(self, **variables: Any) -> str:
        """The template's text; raises TemplateProblem on any error inside it, past `max_chars` or past
        `max_seconds` (its worker is then left inside the render: every later render is refused at once)."""
        if self._worker.stuck:
            raise TemplateProblem(f"the chat template did not finish an earlier render within "
                                  f"{self.max_seconds:g}s")
        try:
            return bounded_call(lambda: self._render(variables), "the chat template's render",
                                timeout_s=self.max_seconds, bound="a chat render's bound",
                                worker=self._worker)
        except CallTimeout:
            raise TemplateProblem(f"the chat template did not finish rendering within {self.max_seconds:g}s "
                                  "(a loop without end?)") from None

    def _render(self, variables: dict[str, Any]) -> str:
        out: list[str] = []
        size = 0
        self._guard.reset()  # the sizes it remembers are this render's containers'
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
