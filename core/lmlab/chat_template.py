"""A model's own chat template: the Jinja program in its tokenizer files that turns a conversation
into the text the model was tuned on, rendered as transformers' ``apply_chat_template`` renders it.

The template comes from outside (a downloaded model), so it runs in Jinja's immutable sandbox: it can
read the messages and call ``raise_exception``, nothing else. ``{% generation %}`` blocks (which mark
the assistant's tokens for training) render their body.
"""

import json
from datetime import datetime

from lmlab.errors import UserError


def render(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, where: str = "chat template") -> str:
    """The conversation ``messages`` ({"role", "content"} dicts) as the template writes it, ending with
    the assistant's prompt when ``add_generation_prompt``; a UserError naming ``where`` when the
    template does not compile or raises."""
    import jinja2

    try:
        compiled = _environment().from_string(template)
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                               eos_token=eos_token, tools=None, documents=None)
    except jinja2.TemplateError as exc:
        raise UserError(f"the chat template failed: {exc}", key=where) from None


def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: the body, rendered as it stands."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def prompt_text(tokenizer, messages: list[dict], where: str = "chat template") -> str:
    """The conversation with the assistant's turn to come, through the tokenizer's own template
    (``Tokenizer.chat_template``), as text: the special tokens it writes encode to their ids."""
    def token(name: str) -> str:
        found = tokenizer.special_id(name)
        return tokenizer.decode([found]) if found is not None else ""

    return render(tokenizer.chat_template(), messages, bos_token=token("bos"), eos_token=token("eos"), where=where)


def prompt_ids(tokenizer, messages: list[dict], where: str = "chat template") -> list[int]:
    """:func:`prompt_text`'s token ids."""
    return [int(i) for i in tokenizer.encode(prompt_text(tokenizer, messages, where))]
