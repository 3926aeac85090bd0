"""The data slot: where the training text comes from, and the record type for structured documents."""

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Union

from pydantic import model_validator

from lmlab.api.options import Field, Options, refuse_moved
from lmlab.api.plugin import Plugin


@dataclass(frozen=True)
class Segment:
    """A piece of a [Record][lmlab.api.data.Record]'s text, and whether a prompt-masked objective
    scores its tokens."""

    text: str
    """The piece of text, joined to its neighbours with nothing in between."""
    scored: bool = True
    """Whether a prompt-masked objective (``sft``) scores this segment's tokens."""
    label: int = 1
    """What the prepared loss mask holds on this segment's tokens when it is scored, 1–255 (API 1.10):
    an objective that scores several parts of a record differently tells them apart by it (a
    preference pair: 1 on the chosen answer, 2 on the rejected one). An unscored segment's mask is 0
    whatever its label."""

    def __post_init__(self):
        if not isinstance(self.label, int) or not 1 <= self.label <= 255:
            raise ValueError(f"Segment.label must be an integer in 1..255, got {self.label!r}")

    @property
    def mask_value(self) -> int:
        """The loss mask's value on this segment's tokens: its label when scored, else 0."""
        return self.label if self.scored else 0


@dataclass(frozen=True)
class Record:
    """A document in parts, so that instruction data keeps the prompt apart from the response.

    ``lmlab prepare`` tokenises the segments one after another (adding nothing between them) and
    writes, beside the tokens, a mask that holds each scored segment's
    [label][lmlab.api.data.Segment.label] (1 unless set) on its tokens, and on the end-of-document
    token the last segment's (1 when that one is unscored), 0 on the others: a prompt-masked objective (``sft``) scores only where it
    is 1, while ``causal-lm`` trains on the whole text. Filters decide on the whole
    [text][lmlab.api.data.Record.text] and rewrite each segment on its own, so a replacement never
    crosses the prompt/response boundary.
    """

    segments: tuple[Segment, ...]
    """The parts of the document, in order."""

    @classmethod
    def prompt_response(cls, prompt: str, response: str) -> "Record":
        """An unscored prompt followed by a scored response (an Alpaca-style example)."""
        return cls((Segment(prompt, scored=False), Segment(response, scored=True)))

    @property
    def text(self) -> str:
        """The whole text: the segments' texts joined with nothing in between."""
        return "".join(s.text for s in self.segments)

    def map_text(self, fn: Callable[[str], str]) -> "Record":
        """The record with ``fn`` applied to the text of every segment."""
        return Record(tuple(Segment(fn(s.text), s.scored, s.label) for s in self.segments))


#: The roles a [Message][lmlab.api.data.Message] may have, as OpenAI's chat format names them.
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Message:
    """One turn of a [Conversation][lmlab.api.data.Conversation] (API 1.21)."""

    role: str
    """Who speaks: ``"system"``, ``"user"`` or ``"assistant"``."""
    content: str
    """What is said."""

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Message.role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if not isinstance(self.content, str):
            raise ValueError(f"Message.content must be a str, got {type(self.content).__name__}")


@dataclass(frozen=True)
class Conversation:
    """A chat as turns, written out by the run's chat template (API 1.21).

    ``lmlab prepare`` renders it with the data source's
    [conversation_template][lmlab.api.data.DataSource.conversation_template], else the tokenizer's own
    (``Tokenizer.chat_template``), into a [Record][lmlab.api.data.Record] whose scored segments are the
    assistant's turns as the template writes them (the text after the assistant's prompt, up to the
    next turn, with the template's end-of-turn marker), so a prompt-masked objective (``sft``) learns
    only the answers. Filters see the rendered Record.
    """

    messages: tuple[Message, ...]
    """The turns, in order; at least one is the assistant's."""

    def as_dicts(self) -> list[dict]:
        """The turns as the ``{"role", "content"}`` dicts a Jinja chat template reads."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


Document = Union[str, Record, Conversation]
"""What a data source yields: plain text, a [Record][lmlab.api.data.Record] whose segments say
which parts are scored, or a [Conversation][lmlab.api.data.Conversation] (API 1.21), written out by the
chat template."""


@dataclass(frozen=True)
class ChatTemplate:
    """How a chat becomes the prompt an instruction-tuned run was trained on (API 1.8), for ``lmlab
    serve``'s ``/v1/chat/completions``: the last user message is the instruction, a system message
    (if any) the input, and the model's answer ends at ``stop`` (or at the tokenizer's EOS)."""

    prompt: str
    """The prompt of a turn with an input: ``{instruction}`` and ``{input}`` are replaced."""
    prompt_no_input: str
    """The prompt of a turn without one: ``{instruction}`` is replaced."""
    stop: str | None = None
    """Text that ends an answer, as training taught (``response_end``); None: EOS only."""

    def render(self, instruction: str, given: str = "") -> str:
        """The prompt for one turn."""
        template = self.prompt if given.strip() else self.prompt_no_input
        return template.replace("{instruction}", instruction).replace("{input}", given)


def document_text(doc: str | Record) -> str:
    """The whole text of a document, plain or a Record."""
    return doc if isinstance(doc, str) else doc.text


#: ``[data]`` keys of the older spelling of the order slot (``data.curriculum``, API 1.10 to 1.17) → the
#: ``[order]`` key each became. A manifest giving one is refused; ``lmlab.upgrade`` reads run folders
#: recorded with them.
MOVED_TO_ORDER = {"curriculum": "use", "curriculum_start": "start", "curriculum_steps": "steps",
                  "curriculum_pacing": "pacing"}

#: ``data.curriculum`` value → the ``order`` plugin it stands for: the same name, but for ``objective``,
#: which as an order plugin is ``difficulty`` (a plugin must not share its name with a slot).
CURRICULUM_ORDERS = {"length": "length", "rarity": "rarity", "objective": "difficulty"}

#: The ``[data]`` key of the older spelling of replay (API 1.4 to 1.18) → the ``order`` plugin it became
#: and the option its value is.
MOVED_TO_REPLAY = {"replay": ("replay", "share")}


class DataOptions(Options):
    """Options every data source has; a plugin's options subclass these."""

    val_fraction: float = Field(
        0.1, gt=0, lt=1, help="share of the corpus held out for validation: the end of a single document, "
                              "else every (1/val_fraction)-th document")

    @model_validator(mode="before")
    @classmethod
    def _moved_to_order(cls, values):
        # API 1.18 moved the older spelling of the order slot, 1.19 replay.
        kind = values.get("curriculum") if isinstance(values, dict) else None
        use = CURRICULUM_ORDERS.get(kind, "<name>") if isinstance(kind, str) else "<name>"
        refuse_moved("data", values, "the order slot", {
            **{key: f'[order] use = "{use}" with start, steps, pacing (data.{key} is order.{new})'
               for key, new in MOVED_TO_ORDER.items()},
            **{key: f'[order] use = "{order}" with {option} = {{value}}'
               for key, (order, option) in MOVED_TO_REPLAY.items()}})
        return values


class DataSource(Plugin):
    """Yields documents; ``lmlab prepare`` filters, tokenises and caches them once.

    [documents][lmlab.api.data.DataSource.documents] is consumed as a stream, in the main process,
    once per preparation of the token cache (by ``lmlab prepare``, or by ``lmlab run`` or another
    command that needs the tokens when the cache lacks the variant's entry), so a corpus larger than
    memory works: yield documents one at a time, as ``str`` or as [Record][lmlab.api.data.Record].
    Raise [UserError][lmlab.api.errors.UserError] (naming the file and line) for bad input.

    The validation split is deterministic: when the corpus (after the filters) is one text document,
    its last ``val_fraction`` of characters (nanoGPT's tiny-shakespeare split); otherwise documents
    are assigned in corpus order so that after every n documents, floor(n · val_fraction) of them are
    validation ones (every tenth document for 0.1, spread evenly through the corpus).
    """

    slot = "data"
    Options = DataOptions
    yields_records: ClassVar[bool | None] = None
    """What [documents][lmlab.api.data.DataSource.documents] yields, when the plugin can say before
    reading (API 1.6): True, only [Record][lmlab.api.data.Record]s; False, only plain text; None, it
    depends on the data. An objective that scores only parts of Records (``sft``) refuses plain text
    at ``lmlab check`` instead of at the first batch."""

    def documents(self) -> Iterable[Document]:
        """The corpus, one document at a time, in a fixed order.

        Called in the main process by the preparation (iterated to the end; an interrupted
        preparation that resumes calls it again and skips the documents it already has, so the
        order must be the same every time) and by ``lmlab eval``, which points the source at a
        held-out file and reads [Record][lmlab.api.data.Record]s until it has enough.

        Returns:
            An iterable (a generator, typically) of ``str`` or [Record][lmlab.api.data.Record];
            anything else fails the preparation.

        Raises:
            UserError: Input that cannot be read (naming the file and line).
        """
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A string that changes whenever the documents change; part of the token-cache key.

        Called in the main process whenever the cache key is computed (each ``lmlab prepare`` and
        ``lmlab run`` of the variant), so it should cost less than reading the corpus. The default
        hashes the plugin's name and options; sources that read files should also hash their contents.
        """
        blob = json.dumps(self.options.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(f"{self.name}:{blob}".encode()).hexdigest()

    def chat_template(self) -> ChatTemplate | None:
        """The instruction template of this source's records, if it has one (API 1.8): ``lmlab serve``
        offers chat completions for runs trained on it. Called on the run's data plugin as
        configured, without reading any data. Default None: completions only."""
        return None

    def conversation_template(self) -> str | None:
        """The Jinja chat template this source's [Conversation][lmlab.api.data.Conversation]s are
        written with (API 1.21), in place of the tokenizer's own; ``lmlab serve`` and ``lmlab generate
        --chat`` then chat through it too. Called on the source as configured, without reading data.
        Default None: the tokenizer's (a tokenizer without one cannot prepare Conversations)."""
        return None

    def parts(self, size: int) -> list | None:
        """The corpus cut into pieces that other processes read on their own (API 1.16), so that a
        Dask preparation (``lmlab prepare --executor dask``) reads it on the workers and this
        process only plans.

        Called in the main process on the instance whose fingerprint is in the cache key; it must
        not read the documents (a file list and sizes are fine).

        Args:
            size: About how many bytes of source each piece should hold.

        Returns:
            Small picklable descriptions (file names, byte ranges), in corpus order, such that
            [documents_in][lmlab.api.data.DataSource.documents_in] of each, one after another,
            yields exactly what [documents][lmlab.api.data.DataSource.documents] yields. Default
            None: the source cannot be cut, and the main process reads it.
        """
        return None

    def documents_in(self, part) -> Iterable[Document]:
        """The documents of one piece from [parts][lmlab.api.data.DataSource.parts] (API 1.16), in
        order. Called in a worker process, on a new instance with the same options, once per piece;
        [stats][lmlab.api.data.DataSource.stats] is then asked for that piece's counts, which the
        preparation sums over the pieces.
        """
        raise NotImplementedError(f"{type(self).__name__} cuts its corpus into parts but cannot read one")

    def stats(self) -> dict[str, int]:
        """Counts worth reporting once [documents][lmlab.api.data.DataSource.documents] is exhausted
        (lines or files skipped, ...).

        Called once per preparation, in the main process, after the last document (for a source cut
        into [parts][lmlab.api.data.DataSource.parts] under Dask: after each part, on a worker, and the
        counts summed). ``lmlab prepare``
        prints them and records them in the token cache's index and in ``summary.json``
        (``data.source``). Default: none.
        """
        return {}
