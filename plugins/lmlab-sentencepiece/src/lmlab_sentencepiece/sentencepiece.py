"""SentencePiece subword tokenizer, trained on the run's training split.

SentencePiece (Kudo & Richardson 2018, https://arxiv.org/abs/1808.06226) learns subwords from raw
text, treating the space as an ordinary symbol (shown as "▁"), with one of two algorithms:
byte-pair encoding (Sennrich et al. 2016, https://arxiv.org/abs/1508.07909), which greedily merges
the most frequent pair of pieces, or the unigram language model (Kudo 2018,
https://arxiv.org/abs/1804.10959), which prunes a large seed vocabulary to the pieces that keep
the corpus likelihood highest.

The trainer is configured so that ``decode(encode(text)) == text`` for any text made of characters
it has seen (and for any text at all with ``byte_fallback``): no Unicode normalisation, no
collapsing of repeated spaces, no dummy leading space. Training is deterministic: every sentence is
used (no sampling) on one thread.
"""

import io
from pathlib import Path
from typing import Literal, Sequence

import sentencepiece as spm

from lmlab.api import Field, Options, Tokenizer, UserError

MODEL_FILE = "sentencepiece.model"
NEWLINE = "\n"


class SentencePieceOptions(Options):
    model_type: Literal["bpe", "unigram"] = Field("bpe", help="subword algorithm: byte-pair merges or unigram LM")
    vocab_size: int = Field(1024, ge=8, help="number of pieces, including <unk>, <s>, </s> and the newline")
    character_coverage: float = Field(
        1.0, gt=0, le=1, help="share of the characters to cover; rarer ones become <unk> (or bytes)")
    byte_fallback: bool = Field(False, help="encode unseen characters as UTF-8 byte pieces instead of <unk>")
    split_digits: bool = Field(False, help="put every digit in a piece of its own")
    max_sentence_length: int = Field(
        16384, gt=0, help="longest training line in bytes; longer lines are left out of training")


class SentencePieceTokenizer(Tokenizer):
    Options = SentencePieceOptions

    def __init__(self, options: SentencePieceOptions | None = None):
        super().__init__(options)
        self.sp: spm.SentencePieceProcessor | None = None
        self.model_bytes = b""

    def fit(self, text: str, workdir: Path) -> None:
        o = self.options
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                # SentencePiece trains on lines, so a newline never appears inside a training
                # sentence. Making "\n" a user-defined symbol gives it a piece of its own, which
                # encode() places between the lines and decode() turns back into "\n".
                sentence_iterator=iter(text.split(NEWLINE)), model_writer=model,
                user_defined_symbols=[NEWLINE],
                model_type=o.model_type, vocab_size=o.vocab_size, character_coverage=o.character_coverage,
                byte_fallback=o.byte_fallback, split_digits=o.split_digits,
                max_sentence_length=o.max_sentence_length,
                # Faithful whitespace: NFKC would rewrite characters, and the defaults would
                # collapse runs of spaces and add a leading space that decode cannot tell apart.
                normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
                # Determinism: train on every sentence (no random sample) with one thread.
                input_sentence_size=0, num_threads=1, minloglevel=2,
            )
        except RuntimeError as e:  # e.g. "Vocabulary size too high (5000). Please set it to a value <= 1948."
            raise UserError(f"sentencepiece could not train: {str(e).split('] ', 1)[-1]}",
                            key="tokenizer.vocab_size") from e
        self._use(model.getvalue())

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
        eos = self._fitted().eos_id()
        return eos if eos >= 0 else None

    def save(self, directory: Path) -> None:
        self._fitted()
        (Path(directory) / MODEL_FILE).write_bytes(self.model_bytes)

    def load(self, directory: Path) -> None:
        self._use((Path(directory) / MODEL_FILE).read_bytes())

    def _use(self, model_bytes: bytes) -> None:
        self.model_bytes = model_bytes
        self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        self.newline_id = self.sp.piece_to_id(NEWLINE)

    def _fitted(self) -> spm.SentencePieceProcessor:
        if self.sp is None:
            raise RuntimeError("sentencepiece tokenizer used before fit() or load()")
        return self.sp
