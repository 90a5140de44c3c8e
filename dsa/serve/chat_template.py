"""Chat templates rendered as transformers renders them (``apply_chat_template``).

A template is untrusted code from a checkpoint folder: it runs in jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension (``{% break %}``, ``{% continue %}``), the ``{% generation %}`` block (rendered as its
body), a ``tojson`` filter that keeps non-ASCII text and does not escape HTML, and the globals
``raise_exception(message)`` and ``strftime_now(format)``. The variables are ``messages``,
``add_generation_prompt``, ``tools``, ``documents`` and the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...).
"""
import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template raised (``raise_exception``) or could not be parsed."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it; rendered as is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat_template: cannot parse it: {e}") from e


def render_chat(template: str, messages: list, add_generation_prompt: bool = True, tools=None, documents=None,
                **variables) -> str:
    """The prompt text of one conversation (``messages``: dicts with ``role`` and ``content``)."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"messages: expected a list of dicts with 'role' and 'content', got {messages!r:.200}")
    try:
        return compile_template(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                                 tools=tools, documents=documents, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template: {e}") from e
