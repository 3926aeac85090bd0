"""A pretrained model's own tokenizer: ``hf``, the fast tokenizer of a Hugging Face folder (tokenizer.json).

A pretrained model understands only the token ids it was trained with, so fine-tuning it (``[init]
from`` a Hugging Face folder) must tokenise with its tokenizer, not with one fitted on the new data.
``tokenizer.json`` is the serialisation of Hugging Face's ``tokenizers`` library: normaliser,
pre-tokeniser, model (byte-pair encoding, Sennrich et al. 2016, arXiv:1508.07909; WordPiece; the
unigram LM, Kudo 2018, arXiv:1804.10959), post-processor and decoder in one file. This plugin runs it
with that library, as transformers' fast tokenizers do, so the ids are the ones the model was trained on.

Encoding adds no special tokens: the post-processor's template (Llama's ``<s>`` before every
sequence) is left out (``add_special_tokens=False``), because ``lmlab prepare`` marks the end of each
document itself, with ``eos_id``. A special token's text inside a document (``"</s>"``) becomes that
token, as in transformers, unless ``split_special_tokens``. ``decode`` keeps special tokens, so
``decode(encode(text)) == text`` wherever the tokenizer itself is lossless (byte-level BPE, byte
fallback).

The end-of-text id comes from ``tokenizer_config.json`` (``eos_token``), else ``generation_config.json``
or ``config.json`` (``eos_token_id``; the first of a list); the other named special tokens (bos, unk,
pad, mask, sep, cls) from the same places. ``save`` writes tokenizer.json byte for byte and those ids
to ``lmlab_hf.json``, so a run folder's ``tokenizer/`` reloads without the original folder.

There is nothing to learn: fitting reads the tokenizer at ``path``.
"""

import hashlib
import json
from pathlib import Path
from typing import Iterable, Literal, Sequence

import numpy as np
from tokenizers import Tokenizer as FastTokenizer

from lmlab.api import Field, Options, Tokenizer, UserError

TOKENIZER_FILE = "tokenizer.json"
STATE_FILE = "lmlab_hf.json"
# The files besides tokenizer.json that the special token ids come from (see special_ids): the
# tokenizer's config names the tokens, the model's configs give bos/eos/pad as ids.
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
MODEL_CONFIGS = ("generation_config.json", "config.json")
CONFIG_FILES = (TOKENIZER_CONFIG, *MODEL_CONFIGS)
SPECIAL_NAMES = ("bos", "eos", "unk", "pad", "mask", "sep", "cls")


class HFTokenizerOptions(Options):
    path: Path = Field(..., help="a Hugging Face model folder holding tokenizer.json, or the tokenizer.json file "
                                 "itself; [init] from a Hugging Face folder sets it to that folder")
    unknown: Literal["error", "keep"] = Field(
        "error", help='text that encodes to the unknown token: "error" stops naming it, "keep" trains on the '
                      "unknown id")
    split_special_tokens: bool = Field(
        False, help='encode special-token text inside documents ("</s>") as ordinary text, not as the special token')


class HFTokenizer(Tokenizer):
    """``hf``: the tokenizer.json of a pretrained model, through the ``tokenizers`` library."""

    Options = HFTokenizerOptions
    api = ">=1.20,<2"  # save_hf; fingerprint (1.5: an older core would reuse tokens of a replaced tokenizer.json); special_id

    def __init__(self, options: HFTokenizerOptions | None = None):
        super().__init__(options)
        self.tokenizer: FastTokenizer | None = None
        self.json_bytes = b""
        self.special: dict[str, int] = {}
        self.template: str | None = None  # the model's chat template (chat_template.jinja)

    # -- "fitting": reading the pretrained tokenizer ----------------------------------------------

    def fingerprint(self) -> str:
        """A hash of tokenizer.json and the files its special ids come from: the token cache is keyed on
        it, so a tokenizer replaced at the same path re-tokenises the corpus."""
        file = self._source_file()
        digest = hashlib.sha256()
        for path in (file, *(file.parent / name for name in CONFIG_FILES)):
            digest.update(path.name.encode() + b"\0")
            digest.update(path.read_bytes() if path.is_file() else b"(absent)")
        return digest.hexdigest()

    def fit(self, text: str, workdir: Path) -> None:
        self._read_source()

    def fit_documents(self, documents: Iterable[str], workdir: Path) -> None:
        self._read_source()  # nothing to learn: the documents are not even read

    def _source_file(self) -> Path:
        path = Path(self.options.path)
        return path / TOKENIZER_FILE if path.is_dir() else path

    def _read_source(self) -> None:
        file = self._source_file()
        if not file.is_file():
            raise UserError(f"{file}: no such file (a Hugging Face fast tokenizer; "
                            "AutoTokenizer.from_pretrained(...).save_pretrained(folder) writes one)",
                            key="tokenizer.path")
        self._use(file.read_bytes(), file.parent, key="tokenizer.path")

    def load(self, directory: Path) -> None:
        """A saved state (tokenizer/ of a run) or a Hugging Face folder ([init] from one)."""
        directory = Path(directory)
        state = directory / STATE_FILE
        special = json.loads(state.read_text())["special"] if state.is_file() else None
        self._use((directory / TOKENIZER_FILE).read_bytes(), directory, special=special)

    def save(self, directory: Path) -> None:
        self._fitted()
        (Path(directory) / TOKENIZER_FILE).write_bytes(self.json_bytes)
        (Path(directory) / STATE_FILE).write_text(json.dumps({"special": self.special}, indent=1, sort_keys=True))
        if self.template is not None:
            (Path(directory) / TEMPLATE_FILE).write_text(self.template, encoding="utf-8")

    def chat_template(self) -> str | None:
        self._fitted()  # known before fitting: the preparation writes conversations out with it first
        return self.template

    def save_hf(self, directory: Path) -> None:
        """tokenizer.json as read, the chat template, and a tokenizer_config.json naming the special
        tokens by their pieces."""
        (Path(directory) / TOKENIZER_FILE).write_bytes(self.json_bytes)
        if self.template is not None:
            (Path(directory) / TEMPLATE_FILE).write_text(self.template, encoding="utf-8")
        pieces = {f"{name}_token": self._fitted().id_to_token(i) for name, i in sorted(self.special.items())
                  if name in ("bos", "eos", "unk", "pad", "mask", "sep", "cls")}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **pieces}
        (Path(directory) / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))

    def _use(self, json_bytes: bytes, folder: Path, special: dict | None = None, key: str | None = None) -> None:
        try:
            tokenizer = FastTokenizer.from_str(json_bytes.decode("utf-8"))
        except Exception as exc:  # the library raises plain Exceptions for a malformed file
            raise UserError(f"{folder / TOKENIZER_FILE}: not a tokenizers file: {exc}", key=key) from None
        tokenizer.encode_special_tokens = self.options.split_special_tokens
        self.tokenizer, self.json_bytes = tokenizer, json_bytes
        self.template = chat_template(folder)
        self.special = {k: int(v) for k, v in special.items()} if special is not None else special_ids(folder, tokenizer)
        self._size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    # -- the slot ---------------------------------------------------------------------------------

    def encode(self, text: str) -> np.ndarray:
        encoding = self._fitted().encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int64)
        unk = self.special.get("unk")
        if self.options.unknown == "error" and unk is not None:
            hits = np.flatnonzero(ids == unk)
            if hits.size:
                start, end = encoding.offsets[int(hits[0])]
                raise UserError(f"{text[start:end]!r} encodes to the unknown token (id {unk}): the pretrained "
                                f"tokenizer has no piece for it ({hits.size} unknown token(s) in this text); set "
                                'unknown = "keep" to train on the unknown id', key="tokenizer.unknown")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._fitted().decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        self._fitted()
        return self._size

    @property
    def eos_id(self) -> int | None:
        return self.special.get("eos")

    @property
    def bos_id(self) -> int | None:
        return self.special.get("bos")

    @property
    def pad_id(self) -> int | None:
        return self.special.get("pad")  # the same id special_id("pad") names (API 1.4)

    def special_id(self, name: str) -> int | None:
        self._fitted()
        return self.special.get(name)

    def _fitted(self) -> FastTokenizer:
        # Fitting only reads the pretrained files, so a tokenizer asked before it is fitted reads them then.
        if self.tokenizer is None:
            self._read_source()
        return self.tokenizer


def special_ids(folder: Path, tokenizer: FastTokenizer) -> dict[str, int]:
    """name → id of the special tokens a Hugging Face folder declares (see the module docstring)."""
    special: dict[str, int] = {}
    config = _read_json(folder / TOKENIZER_CONFIG)
    for name in SPECIAL_NAMES:
        token = config.get(f"{name}_token")
        if isinstance(token, dict):  # an AddedToken written out: {"content": "</s>", ...}
            token = token.get("content")
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            special[name] = tokenizer.token_to_id(token)
    for file in MODEL_CONFIGS:
        values = _read_json(folder / file)
        for name in ("bos", "eos", "pad"):
            value = values.get(f"{name}_token_id")
            if isinstance(value, list):  # several end tokens (chat models): the first is the document end
                value = value[0] if value else None
            if name not in special and isinstance(value, int):
                special[name] = value
    unk = getattr(tokenizer.model, "unk_token", None)  # BPE and WordPiece name theirs
    if "unk" not in special and isinstance(unk, str) and tokenizer.token_to_id(unk) is not None:
        special["unk"] = tokenizer.token_to_id(unk)
    unk_id = getattr(tokenizer.model, "unk_id", None)  # Unigram numbers its own
    if "unk" not in special and isinstance(unk_id, int):
        special["unk"] = unk_id
    return special


def chat_template(folder: Path) -> str | None:
    """The folder's chat template: chat_template.jinja (transformers ≥ 4.47 writes it apart), else
    tokenizer_config.json's ``chat_template`` (a string, or named templates of which ``default``)."""
    path = Path(folder) / TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    given = _read_json(Path(folder) / TOKENIZER_CONFIG).get("chat_template")
    if isinstance(given, list):
        given = next((t.get("template") for t in given if isinstance(t, dict) and t.get("name") == "default"), None)
    return given if isinstance(given, str) and given.strip() else None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return value if isinstance(value, dict) else {}
