"""SentencePiece subword tokenizer, trained on (a sample of) the run's training split.

SentencePiece (Kudo & Richardson 2018, https://arxiv.org/abs/1808.06226) learns subwords from raw
text, treating the space as an ordinary symbol (shown as "▁"), with one of two algorithms:
byte-pair encoding (Sennrich et al. 2016, https://arxiv.org/abs/1508.07909), which greedily merges
the most frequent pair of pieces, or the unigram language model (Kudo 2018,
https://arxiv.org/abs/1804.10959), which prunes a large seed vocabulary to the pieces that keep
the corpus likelihood highest.

The trainer is configured so that ``decode(encode(text)) == text`` for any text made of characters
it has seen (and for any text at all with ``byte_fallback``, which spells unseen characters as
UTF-8 byte pieces): no Unicode normalisation, no collapsing of repeated spaces, no dummy leading
space, and the newline a piece of its own. A run of spaces may be a piece (indentation in code).

The vocabulary starts with pieces whose ids never change: ``<unk>`` 0, ``<|endoftext|>`` 1 (the
end-of-document token ``lmlab prepare`` places after every document), ``<pad>`` 2, ``<mask>`` 3
when asked for. They are control symbols: ``encode`` never produces them, not even for text that
spells them out (a document quoting "<|endoftext|>" is tokenised as ordinary characters, so it
cannot fake a document boundary), and ``decode`` renders them as nothing. Then come the newline and
the user-defined symbols, which the encoder cuts out of any text before splitting it (so "BRCA1"
is one id in "BRCA1-mutant" or "(BRCA1)" alike), then the byte pieces, then the learned ones.

Training on a sample: SentencePiece trains on lines ("sentences") held in memory, with a cost that
grows faster than the text, so a large corpus is sampled while it streams by. Every line gets a
random priority from a seeded generator, and the sample is the lines of lowest priority that fit in
``sample_mb`` and ``max_sentences``: a bottom-k sample (Cohen & Kaplan 2007, "Summarizing data using
bottom-k sketches"; with uniform priorities, a reservoir sample in the sense of Vitter 1985), kept in
a heap, so memory stays bounded whatever the corpus's size and a line whose priority is above the
evicted ones is dismissed with one comparison. The sample is a function of the seed and the lines in
corpus order only (``lmlab prepare`` streams the training documents in corpus order, in one
process, whatever its number of workers), and goes to the trainer in corpus order; a corpus smaller
than the limits is used whole. Training runs on one thread: SentencePiece's result depends on its
thread count.
"""

import heapq
import io
import re
from pathlib import Path
from typing import Iterable, Iterator, Literal, Sequence

import numpy as np
import sentencepiece as spm
from pydantic import model_validator

from lmlab.api import Field, Options, Tokenizer, UserError

MODEL_FILE = "sentencepiece.model"
NEWLINE = "\n"
SPACE = "\u2581"  # "▁": how SentencePiece writes a space inside a piece
UNK, EOS, PAD, MASK = "<unk>", "<|endoftext|>", "<pad>", "<mask>"
BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
CHUNK_CHARS = 1 << 20  # a long document is split into lines this much at a time


class SentencePieceOptions(Options):
    model_type: Literal["bpe", "unigram"] = Field("bpe", help="subword algorithm: byte-pair merges or unigram LM")
    vocab_size: int = Field(
        1024, ge=8, help="number of pieces, including the special ones, the newline, the user-defined symbols "
                         "and (with byte_fallback) the 256 byte pieces")
    character_coverage: float = Field(
        1.0, gt=0, le=1, help="share of the characters to cover; rarer ones become <unk> (or bytes)")
    byte_fallback: bool = Field(False, help="encode unseen characters as UTF-8 byte pieces instead of <unk>")
    split_digits: bool = Field(False, help="put every digit in a piece of its own")
    user_defined_symbols: list[str] = Field(
        [], help='strings kept whole, one id each, wherever they occur (e.g. gene names: ["BRCA1", "TP53"])')
    mask_token: bool = Field(False, help='reserve <mask> (id 3) for masked-LM objectives: special_id("mask")')
    max_sentence_length: int = Field(
        16384, gt=0, help="longest training line in bytes; longer lines are left out of training")
    sample_mb: float = Field(
        64.0, gt=0, help="train on a seeded random sample of at most this many MiB of training lines "
                         "(the whole text when it is smaller)")
    max_sentences: int = Field(1_000_000, gt=0, help="and of at most this many lines")
    sample_seed: int = Field(0, help="seed of the training sample")

    @model_validator(mode="after")
    def _symbols_can_be_pieces(self):
        seen = set()
        for symbol in self.user_defined_symbols:
            problem = (
                "is empty" if not symbol else
                "contains a newline, which always ends a piece" if NEWLINE in symbol else
                "is given twice" if symbol in seen else
                "is a special token's text" if symbol in (UNK, EOS, PAD, MASK) else
                "is a byte piece's text" if BYTE_PIECE.fullmatch(symbol) else None)
            if problem:
                raise UserError(f"{symbol!r} {problem}", key="tokenizer.user_defined_symbols")
            seen.add(symbol)
        return self


class SentencePieceTokenizer(Tokenizer):
    Options = SentencePieceOptions
    api = ">=1.4,<2"  # pad_id, special_id; fit_documents (1.3)

    def __init__(self, options: SentencePieceOptions | None = None):
        super().__init__(options)
        self.sp: spm.SentencePieceProcessor | None = None
        self.model_bytes = b""
        self.sample: dict = {}  # what the last fit trained on: lines seen, lines and bytes sampled

    # -- fitting -----------------------------------------------------------------------------------

    def fit(self, text: str, workdir: Path) -> None:
        self.fit_documents([text], workdir)

    def fit_documents(self, documents: Iterable[str], workdir: Path) -> None:
        o = self.options
        sample = LineSample(int(o.sample_mb * 2**20), o.max_sentences, o.max_sentence_length, o.sample_seed)
        for document in documents:
            sample.add(document)
        sentences = sample.lines()
        self.sample = {"lines": sample.seen, "sampled_lines": len(sentences), "sampled_bytes": sample.bytes}
        sampled = len(sentences) < sample.seen
        if not sentences:
            raise UserError("the training split has no line to learn subwords from"
                            + (f" shorter than {o.max_sentence_length} bytes" if sample.seen else ""),
                            key="tokenizer.max_sentence_length" if sample.seen else "data")
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                # SentencePiece trains on lines, so a newline never appears inside a training
                # sentence. Making "\n" a user-defined symbol gives it a piece of its own, which
                # encode() places between the lines and decode() turns back into "\n".
                sentence_iterator=iter(sentences), model_writer=model,
                user_defined_symbols=[NEWLINE, *(s.replace(" ", SPACE) for s in o.user_defined_symbols)],
                control_symbols=[MASK] if o.mask_token else [],
                unk_id=0, eos_id=1, pad_id=2, bos_id=-1, unk_piece=UNK, eos_piece=EOS, pad_piece=PAD,
                model_type=o.model_type, vocab_size=o.vocab_size, character_coverage=o.character_coverage,
                byte_fallback=o.byte_fallback, split_digits=o.split_digits,
                max_sentence_length=o.max_sentence_length,
                # Faithful whitespace: NFKC would rewrite characters, and the defaults would
                # collapse runs of spaces and add a leading space that decode cannot tell apart.
                normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
                # A run of spaces (code's indentation) may be one piece instead of one piece per space:
                # 1.4x fewer tokens on Python source at 1000 pieces, no change on prose.
                allow_whitespace_only_pieces=True,
                # Determinism: the sample above is all there is (no sampling of SentencePiece's own),
                # and one thread (the result depends on the thread count).
                input_sentence_size=0, num_threads=1, minloglevel=2,
            )
        except RuntimeError as e:
            raise _training_error(str(e), o, sampled) from None
        del sentences
        self._use(model.getvalue())

    # -- text <-> ids ------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        # One line at a time, the way the model was trained, joined by the newline piece. Encoding
        # the whole text in one call round-trips too, but per-line BPE is ~3x faster and the
        # batch call never holds one huge sentence.
        lines = self._fitted().encode(text.split(NEWLINE))
        ids = list(lines[0])
        for line in lines[1:]:
            ids.append(self.newline_id)
            ids.extend(line)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._fitted().decode(list(ids))

    @property
    def vocab_size(self) -> int:
        return self._fitted().get_piece_size()

    @property
    def eos_id(self) -> int | None:
        return self.special_id("eos")

    @property
    def pad_id(self) -> int | None:
        return self.special_id("pad")

    def special_id(self, name: str) -> int | None:
        """"unk" 0, "eos" 1 (<|endoftext|>), "pad" 2, "mask" 3 (<mask>, with ``mask_token``)."""
        self._fitted()
        return self._special.get(name)

    def token_id(self, token: str) -> int | None:
        """The id of the piece written ``token`` (a special token, a user-defined symbol, any piece;
        spaces as spaces), else None."""
        sp = self._fitted()
        i = sp.piece_to_id(token.replace(" ", SPACE))
        return None if sp.is_unknown(i) and token != UNK else i

    # -- state -------------------------------------------------------------------------------------

    def save(self, directory: Path) -> None:
        self._fitted()
        (Path(directory) / MODEL_FILE).write_bytes(self.model_bytes)

    def load(self, directory: Path) -> None:
        self._use((Path(directory) / MODEL_FILE).read_bytes())

    def _use(self, model_bytes: bytes) -> None:
        self.model_bytes = model_bytes
        self.sp = sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        self.newline_id = sp.piece_to_id(NEWLINE)
        special = {"unk": sp.unk_id(), "eos": sp.eos_id(), "pad": sp.pad_id(), "bos": sp.bos_id(),
                   "mask": sp.piece_to_id(MASK)}
        self._special = {role: i for role, i in special.items()
                         if i >= 0 and (role == "unk" or not sp.is_unknown(i))}

    def _fitted(self) -> spm.SentencePieceProcessor:
        if self.sp is None:
            raise RuntimeError("sentencepiece tokenizer used before fit() or load()")
        return self.sp


class LineSample:
    """A seeded random sample of the non-empty lines of a stream of documents, at most ``max_bytes``
    (UTF-8) and ``max_lines``: the lines of lowest random priority that fit (bottom-k; see the module
    docstring). Lines longer than ``max_line_bytes`` are left out, as the trainer would."""

    def __init__(self, max_bytes: int, max_lines: int, max_line_bytes: int, seed: int):
        self.max_bytes, self.max_lines, self.max_line_bytes = max_bytes, max_lines, max_line_bytes
        self.rng = np.random.default_rng(seed)
        self.heap: list[tuple[float, int, str, int]] = []  # (-priority, position, line, bytes): max-heap
        self.bytes = 0  # of the lines in the heap
        self.position = 0  # lines seen, empty ones included: each line's place in corpus order
        self.seen = 0  # non-empty lines seen
        # No line with this priority or more can ever join the sample: one of lower priority was
        # evicted to respect the limits, and the lines of lower priority only grow in number.
        self.threshold = 1.0

    def add(self, document: str) -> None:
        for chunk in _line_chunks(document):
            lines = chunk.split(NEWLINE)
            priorities = self.rng.random(len(lines))  # (n_lines,), one draw per line in corpus order
            candidates = np.flatnonzero(priorities < self.threshold)
            for j, priority in zip(candidates.tolist(), priorities[candidates].tolist()):
                line = lines[j]
                if not line or priority >= self.threshold:  # the threshold fell within this chunk
                    continue
                size = len(line.encode("utf-8"))
                if size > self.max_line_bytes:
                    continue
                heapq.heappush(self.heap, (-priority, self.position + j, line, size))
                self.bytes += size
                while self.bytes > self.max_bytes or len(self.heap) > self.max_lines:
                    evicted, _, _, evicted_size = heapq.heappop(self.heap)
                    self.bytes -= evicted_size
                    self.threshold = -evicted
            self.position += len(lines)
            self.seen += len(lines) - lines.count("")

    def lines(self) -> list[str]:
        """The sampled lines, in corpus order."""
        return [line for _, _, line, _ in sorted(self.heap, key=lambda entry: entry[1])]


def _line_chunks(document: str) -> Iterator[str]:
    """``document`` in pieces of about ``CHUNK_CHARS`` cut at newlines (the newlines dropped), so a
    huge document is never held twice as a list of lines."""
    start = 0
    while True:
        end = document.find(NEWLINE, start + CHUNK_CHARS)
        if end < 0:
            yield document[start:]
            return
        yield document[start:end]
        start = end + 1


def _training_error(message: str, o: SentencePieceOptions, sampled: bool) -> UserError:
    """SentencePiece's refusal as one line naming the option to change."""
    text = message.split("] ", 1)[-1].strip()
    # "Vocabulary size too high (5000). Please set it to a value <= 1948."
    if m := re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", text):
        where = (f"the {o.sample_mb:g} MiB training sample (tokenizer.sample_mb) supports" if sampled
                 else "the training split supports")
        return UserError(f"{o.vocab_size} pieces are more than {where} with model_type = {o.model_type!r}; "
                         f"the largest workable value is {m.group(2)}", key="tokenizer.vocab_size")
    # "Vocabulary size is smaller than required_chars. 300 vs 320. Increase vocab_size or ..."
    if m := re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", text):
        return UserError(f"{o.vocab_size} pieces are too few: the characters of the training text and the "
                         f"special pieces need at least {m.group(2)} (or lower tokenizer.character_coverage)",
                         key="tokenizer.vocab_size")
    return UserError(f"sentencepiece could not train: {' '.join(text.split())}", key="tokenizer")
