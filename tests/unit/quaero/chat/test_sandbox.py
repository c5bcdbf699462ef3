"""A chat template runs sandboxed and bounded (quaero/chat/sandbox.py): each problem one line."""
from __future__ import annotations

import pytest

from quaero.chat.sandbox import TemplateProblem, TemplateRunner


@pytest.mark.hostile
@pytest.mark.parametrize("source,needle", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "the chat template raised SecurityError"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "rendered more than 1,000 characters"),
    ("{% for m in messages %}", "does not compile"),
    ("{{ raise_exception('Roles must alternate') }}", "raised TemplateError: Roles must alternate"),
])
def test_templates_are_sandboxed_and_bounded(source, needle):
    with pytest.raises(TemplateProblem, match=needle):
        TemplateRunner(source, max_chars=1000).render(messages=[])
