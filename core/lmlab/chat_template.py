"""A model's own chat template: the Jinja program in its tokenizer files that turns a conversation
into the text the model was tuned on, rendered as transformers' ``apply_chat_template`` renders it.

The template comes from outside (a downloaded model), so it runs in Jinja's immutable sandbox: it can
read the messages and call ``raise_exception``, nothing else. ``{% generation %}`` blocks (which mark
the assistant's tokens for training) render their body.
"""

import json
from datetime import datetime
from functools import lru_cache

from lmlab.errors import UserError


def render(template: str, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, where: str = "chat template") -> str:
    """The conversation ``messages`` ({"role", "content"} dicts) as the template writes it, ending with
    the assistant's prompt when ``add_generation_prompt``; a UserError naming ``where`` when the
    template does not compile or raises."""
    import jinja2

    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                               eos_token=eos_token, tools=None, documents=None)
    except jinja2.TemplateError as exc:
        raise UserError(f"the chat template failed: {exc}", key=where) from None


@lru_cache(maxsize=8)
def _compiled(template: str):
    # Compiling takes milliseconds, rendering microseconds: a corpus of conversations renders one template.
    return _environment().from_string(template)


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


def special_text(tokenizer, name: str) -> str:
    """The text of the tokenizer's special token ``name`` ("bos", "eos"), which encodes to its id; ""
    when it has none."""
    found = tokenizer.special_id(name)
    return tokenizer.decode([found]) if found is not None else ""


def run_template(tokenizer, data) -> str | None:
    """The Jinja chat template a run chats through: its data source's own, else its tokenizer's, else None."""
    own = data.conversation_template() if data is not None else None
    return own if own is not None else tokenizer.chat_template()


def prompt_text(tokenizer, messages: list[dict], where: str = "chat template", template: str | None = None) -> str:
    """The conversation with the assistant's turn to come, as text, through ``template`` (a data
    source's own, rendered with empty special tokens as its conversations were prepared) or the
    tokenizer's (``Tokenizer.chat_template``, with the special tokens it writes, which encode to their ids)."""
    if template is not None:
        return render(template, messages, where=where)
    return render(tokenizer.chat_template(), messages, bos_token=special_text(tokenizer, "bos"),
                  eos_token=special_text(tokenizer, "eos"), where=where)


def prompt_ids(tokenizer, messages: list[dict], where: str = "chat template", template: str | None = None) -> list[int]:
    """:func:`prompt_text`'s token ids."""
    return [int(i) for i in tokenizer.encode(prompt_text(tokenizer, messages, where, template))]
