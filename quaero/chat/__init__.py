"""The model-family seam: which renderer a model gets and quaero's own for any chat template.

registry.py (`[model] renderer`: renderers' families, "template", "auto"), template.py (`TemplateRenderer`:
the Renderer protocol over the model's Jinja chat template, with a bridge synthesized from it), toolcalls.py
(the tool prompt and `<tool_call>` text format for templates that take no tools), sandbox.py (templates as
untrusted code: sandboxed, bounded).
"""
