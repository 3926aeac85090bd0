"""Conversations written out by a chat template, the assistant's turns marked for the loss.

Few templates mark the assistant's text (``{% generation %}``), so the marking is worked out from the
template itself, as fine-tuning libraries do: the conversation up to each assistant turn is rendered
with the assistant's prompt (``add_generation_prompt``), then with that turn; what the second adds to
the first is the turn as the model must write it, its end-of-turn marker included. A template for
which these renderings do not extend one another (one that rewrites earlier turns, as some
reasoning models' templates drop past thoughts) cannot be trained on this way, and is refused.
"""

from dataclasses import dataclass

from lmlab.api import Conversation, Record, Segment
from lmlab.chat_template import render, special_text
from lmlab.errors import UserError


@dataclass(frozen=True)
class ConversationWriter:
    """A chat template and the special tokens' text it is rendered with; picklable, so that the
    processes that read a data source write its conversations out the same way."""

    template: str | None  # None: neither the source nor the tokenizer has one; `missing` says so
    bos: str = ""
    eos: str = ""
    key: str = "tokenizer"  # where the template comes from, named when it fails
    missing: str = ""

    def record(self, conversation: Conversation, where: str) -> Record:
        """The conversation as the template writes it: unscored text, then each assistant turn scored."""
        if self.template is None:
            raise UserError(self.missing, key="data.template")
        messages = conversation.as_dicts()
        if not any(m["role"] == "assistant" for m in messages):
            raise UserError(f"{where}: a conversation without an assistant turn has nothing to learn", key="data")
        segments, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            asked = self._render(messages[:i], True, where)
            answered = self._render(messages[:i + 1], False, where)
            if not asked.startswith(done) or not answered.startswith(asked):
                raise UserError(f"{where}: the chat template writes earlier turns differently once the assistant "
                                f"has answered (turn {i + 1}), so the answers cannot be told apart from the prompt",
                                key=self.key)
            segments += [Segment(asked[len(done):], scored=False), Segment(answered[len(asked):], scored=True)]
            done = answered
        whole = self._render(messages, False, where)
        if not whole.startswith(done):
            raise UserError(f"{where}: the chat template writes the conversation differently from its turns",
                            key=self.key)
        segments.append(Segment(whole[len(done):], scored=False))
        return Record(tuple(s for s in segments if s.text))

    def _render(self, messages: list[dict], prompt: bool, where: str) -> str:
        try:
            return render(self.template, messages, bos_token=self.bos, eos_token=self.eos,
                          add_generation_prompt=prompt, where=self.key)
        except UserError as exc:
            raise UserError(f"{where}: {exc.message}", key=exc.key) from None


def conversation_writer(source, tokenizer) -> ConversationWriter:
    """The writer of ``source``'s conversations: its own template (rendered with empty special
    tokens, which the tokenizer may not know before it is fitted), else ``tokenizer``'s, with its
    special tokens; when neither has one, a writer that refuses every conversation saying so."""
    own = source.conversation_template()
    if own is not None:
        return ConversationWriter(own, key="data.template")
    template = tokenizer.chat_template()
    if template is None:
        return ConversationWriter(None, missing=(
            f"the data source ({source.name}) yields conversations, which a chat template writes out, but the "
            f"tokenizer ({tokenizer.name}) has none: start from a chat model's checkpoint, whose tokenizer has one, "
            "or give a Jinja template as data.template"))
    return ConversationWriter(template, special_text(tokenizer, "bos"), special_text(tokenizer, "eos"))
