"""The tokenizer itself: exact round trips, user-defined symbols kept whole, special tokens with fixed
ids that text cannot produce, byte fallback, and training on a seeded, bounded sample of a stream."""

import heapq
import sysconfig
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from lmlab.api import UserError
from lmlab_sentencepiece import sentencepiece as sp_module
from lmlab_sentencepiece.sentencepiece import MODEL_FILE, LineSample, SentencePieceTokenizer

SHAKESPEARE = Path(__file__).resolve().parents[3] / "data" / "tinyshakespeare.txt"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
pytestmark = pytest.mark.skipif(not SHAKESPEARE.exists(), reason="needs data/tinyshakespeare.txt")
needs_stdlib = pytest.mark.skipif(not any(STDLIB.glob("*.py")), reason="no standard library sources here")
GENES = ["BRCA1", "TP53", "New York"]
MODEL_TYPES = ["bpe", "unigram"]


@pytest.fixture(scope="module")
def text():
    return SHAKESPEARE.read_text(encoding="utf-8")[:50_000]


@pytest.fixture(scope="module")
def stdlib_documents():
    """The standard library's top-level modules: a real corpus of about 4.7 MB, one document per file."""
    return [path.read_text(encoding="utf-8", errors="replace") for path in sorted(STDLIB.glob("*.py"))]


def fitted(text, tmp_path, **options):
    tok = SentencePieceTokenizer(SentencePieceTokenizer.Options(**options))
    tok.fit(text, tmp_path)
    return tok


def pieces(tok, text):
    return [tok.sp.id_to_piece(i) for i in tok.encode(text)]


# -- round trips ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_decode_inverts_encode_exactly_including_newlines_and_spaces(text, tmp_path, model_type):
    tok = fitted(text, tmp_path, model_type=model_type, vocab_size=512)
    assert tok.decode(tok.encode(text)) == text
    tricky = "\n\nKING:  two  spaces \n trailing \n\n"
    assert tok.decode(tok.encode(tricky)) == tricky
    assert len(tok.encode(text)) < len(text) / 2  # it learned subwords, not characters


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_vocab_size_is_honoured(text, tmp_path, model_type):
    tok = fitted(text, tmp_path, model_type=model_type, vocab_size=300)
    assert tok.vocab_size == 300
    assert max(tok.encode(text)) < 300


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fitting_twice_gives_the_same_model(text, tmp_path, model_type):
    a = fitted(text, tmp_path, model_type=model_type, vocab_size=400)
    b = fitted(text, tmp_path, model_type=model_type, vocab_size=400)
    assert a.model_bytes == b.model_bytes


def test_save_then_load_encodes_identically(text, tmp_path):
    tok = fitted(text, tmp_path, vocab_size=400, user_defined_symbols=GENES, mask_token=True)
    tok.save(tmp_path)
    assert (tmp_path / MODEL_FILE).exists()
    fresh = SentencePieceTokenizer(tok.options)
    fresh.load(tmp_path)
    assert fresh.encode(text + " BRCA1") == tok.encode(text + " BRCA1")
    assert fresh.decode(tok.encode(text)) == text
    assert [fresh.special_id(n) for n in ("unk", "eos", "pad", "mask")] == [0, 1, 2, 3]


# -- user-defined symbols ------------------------------------------------------------------------------

@pytest.mark.parametrize("split_digits", [False, True])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_user_defined_symbol_is_one_token_in_every_context(text, tmp_path, model_type, split_digits):
    # BRCA1 occurs in training, TP53 and "New York" do not: symbols are kept whole either way.
    corpus = text + "\nThe BRCA1 gene.\nBRCA1-mutated cells (BRCA1) and xBRCA1y.\n" * 20
    tok = fitted(corpus, tmp_path, model_type=model_type, vocab_size=500, byte_fallback=True,
                 split_digits=split_digits, user_defined_symbols=GENES)
    ids = {gene: tok.token_id(gene) for gene in GENES}
    assert len(set(ids.values())) == 3 and None not in ids.values()
    assert [tok.sp.id_to_piece(i) for i in ids.values()] == ["BRCA1", "TP53", "New▁York"]
    contexts = ["BRCA1", " BRCA1 ", "xBRCA1y", "BRCA1BRCA1", "(BRCA1)", "BRCA1-mutant", "\nBRCA1\n", "aBRCA12",
                "TP53;BRCA1", "p.TP53x", "in New York.", "New YorkNew York", "the BRCA1 and TP53 genes in New York"]
    for context in contexts:
        encoded = tok.encode(context)
        assert tok.decode(encoded) == context
        for gene, i in ids.items():
            assert encoded.count(i) == context.count(gene), (context, gene, pieces(tok, context))
    # Nothing else becomes a symbol's id: near misses are ordinary text.
    for near in ("brca1", "BRCA 1", "BRCA", "NewYork", "TP5"):
        assert not set(tok.encode(near)) & set(ids.values())


@pytest.mark.parametrize("symbols, problem", [
    (["BRCA1", "BRCA1"], "'BRCA1' is given twice"),
    (["a\nb"], "contains a newline"),
    ([""], "is empty"),
    (["<|endoftext|>"], "special token"),
    (["<0x41>"], "byte piece"),
])
def test_symbols_that_cannot_be_pieces_are_refused_naming_the_option(symbols, problem):
    with pytest.raises(UserError, match=f"^tokenizer.user_defined_symbols: .*{problem}"):
        SentencePieceTokenizer.Options(user_defined_symbols=symbols)


# -- special tokens ------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_special_tokens_have_fixed_distinct_ids_whatever_the_corpus_and_options(text, tmp_path, model_type):
    configurations = [
        (text, {}),
        (text[:20_000], {"byte_fallback": True}),
        (text[25_000:], {"user_defined_symbols": GENES, "mask_token": True, "split_digits": True}),
    ]
    for corpus, options in configurations:
        tok = fitted(corpus, tmp_path, model_type=model_type, vocab_size=400, **options)
        assert (tok.special_id("unk"), tok.eos_id, tok.pad_id) == (0, 1, 2)
        assert tok.special_id("eos") == 1 and tok.special_id("pad") == 2
        assert tok.special_id("mask") == (3 if options.get("mask_token") else None)
        assert tok.special_id("bos") is None and tok.special_id("cls") is None
        assert [tok.sp.id_to_piece(i) for i in (0, 1, 2)] == ["<unk>", "<|endoftext|>", "<pad>"]
        assert tok.token_id("<|endoftext|>") == 1 and tok.token_id("<pad>") == 2


def test_text_that_spells_a_special_token_is_ordinary_text(text, tmp_path):
    tok = fitted(text, tmp_path, vocab_size=600, byte_fallback=True, mask_token=True)
    spelled = "a <|endoftext|> b <pad> c <mask>\n<|endoftext|>"
    encoded = tok.encode(spelled)
    assert not {tok.eos_id, tok.pad_id, tok.special_id("mask")} & set(encoded)  # no fake boundary
    assert tok.decode(encoded) == spelled
    assert tok.eos_id not in tok.encode(text)
    # Decoding renders control tokens as nothing, so a generated end of document adds no text.
    words = tok.encode("to be")
    assert tok.decode([tok.eos_id, *words, tok.pad_id, tok.special_id("mask"), tok.eos_id]) == "to be"


# -- byte fallback -------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_byte_fallback_spells_unseen_characters_in_utf8_bytes_and_round_trips(text, tmp_path, model_type):
    unseen = "naïve — 🙂 漢字テスト 🧬\n"
    tok = fitted(text, tmp_path, model_type=model_type, vocab_size=600, byte_fallback=True)
    encoded = tok.encode(unseen)
    assert tok.decode(encoded) == unseen
    assert 0 not in encoded  # no <unk>
    byte_pieces = [tok.sp.id_to_piece(i) for i in encoded if tok.sp.is_byte(i)]
    never_seen = "".join(c for c in unseen if c not in text)
    assert byte_pieces == [f"<0x{b:02X}>" for b in never_seen.encode("utf-8")]

    plain = fitted(text, tmp_path, model_type=model_type, vocab_size=400)
    encoded = plain.encode(unseen)
    assert encoded.count(plain.special_id("unk")) >= 4 and not any(plain.sp.is_byte(i) for i in encoded)
    assert plain.decode(encoded) != unseen


# -- what the corpus supports --------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_vocabulary_too_large_names_the_largest_workable_value_which_works(tmp_path, model_type):
    corpus = "to be or not to be, that is the question\n" * 10
    with pytest.raises(UserError) as caught:
        fitted(corpus, tmp_path, model_type=model_type, vocab_size=5000)
    message = str(caught.value)
    assert message.startswith("tokenizer.vocab_size: 5000 pieces are more than the training split supports")
    assert "\n" not in message
    largest = int(message.rsplit(" ", 1)[-1])
    assert fitted(corpus, tmp_path, model_type=model_type, vocab_size=largest).vocab_size == largest
    with pytest.raises(UserError):
        fitted(corpus, tmp_path, model_type=model_type, vocab_size=largest + 1)


def test_a_vocabulary_too_small_for_the_characters_says_how_many_are_needed(text, tmp_path):
    with pytest.raises(UserError, match=r"^tokenizer.vocab_size: 300 pieces are too few: .* at least 3\d\d"):
        fitted(text, tmp_path, vocab_size=300, byte_fallback=True)  # 256 bytes + characters + specials


def test_vocab_size_below_eight_is_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        SentencePieceTokenizer.Options(vocab_size=4)


# -- the training sample -------------------------------------------------------------------------------

def reference_sample(documents, max_bytes, max_lines, max_line_bytes, seed):
    """The definition: one uniform draw per line in corpus order; sorted by it, the longest prefix of
    eligible lines within both limits; returned in corpus order."""
    lines = [line for document in documents for line in document.split("\n")]
    priorities = np.random.default_rng(seed).random(len(lines))
    eligible = [(p, i) for i, (p, line) in enumerate(zip(priorities, lines))
                if line and len(line.encode()) <= max_line_bytes]
    kept, total = [], 0
    for _, i in sorted(eligible):
        size = len(lines[i].encode())
        if total + size > max_bytes or len(kept) == max_lines:
            break
        kept.append(i)
        total += size
    return [lines[i] for i in sorted(kept)]


@needs_stdlib
@pytest.mark.parametrize("max_bytes, max_lines", [(2**40, 10**9), (300_000, 10**9), (10**9, 2_000), (50_000, 900)])
def test_the_line_sample_is_the_lowest_priority_prefix_that_fits(stdlib_documents, monkeypatch, max_bytes, max_lines):
    documents = stdlib_documents[:40]
    expected = reference_sample(documents, max_bytes, max_lines, 2000, seed=7)
    for chunk_chars in (1 << 20, 4096):  # long documents are split into lines in pieces
        monkeypatch.setattr(sp_module, "CHUNK_CHARS", chunk_chars)
        sample = LineSample(max_bytes, max_lines, 2000, seed=7)
        for document in documents:
            sample.add(document)
        assert sample.lines() == expected
        assert sample.bytes == sum(len(line.encode()) for line in expected) <= max_bytes
    if max_bytes == 2**40:  # no limit reached: every non-empty line short enough, in order
        assert expected == [line for d in documents for line in d.split("\n") if line and len(line.encode()) <= 2000]


@needs_stdlib
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_training_on_a_sample_is_deterministic_and_seeded(stdlib_documents, tmp_path, model_type):
    def fit(**options):
        tok = SentencePieceTokenizer(SentencePieceTokenizer.Options(
            model_type=model_type, vocab_size=1000, byte_fallback=True, sample_mb=0.25, **options))
        tok.fit_documents(iter(stdlib_documents), tmp_path)
        return tok

    a, b, other = fit(), fit(), fit(sample_seed=1)
    assert a.sample["sampled_lines"] < a.sample["lines"] / 10 and a.sample["sampled_bytes"] <= 0.25 * 2**20
    assert a.model_bytes == b.model_bytes
    assert other.model_bytes != a.model_bytes  # it is a sample, and the seed picks it
    source = stdlib_documents[0]
    assert a.decode(a.encode(source)) == source
    assert len(a.encode(source)) < len(source) / 2  # subwords learned from the sample


@needs_stdlib
def test_a_stream_far_larger_than_the_sample_is_consumed_without_being_held(stdlib_documents, tmp_path):
    def stream(copies):  # fresh strings, as a data source reading files would make
        for copy in range(copies):
            for document in stdlib_documents:
                yield f"# copy {copy}\n{document}"

    copies = 20
    streamed = copies * sum(len(d) for d in stdlib_documents)
    tok = SentencePieceTokenizer(SentencePieceTokenizer.Options(vocab_size=2000, sample_mb=1))
    tracemalloc.start()
    started = time.perf_counter()
    try:
        tok.fit_documents(stream(copies), tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    seconds = time.perf_counter() - started
    assert streamed > 90e6 and tok.sample["lines"] > 2_000_000
    assert tok.sample["sampled_bytes"] <= 2**20 and tok.vocab_size == 2000
    # What Python held: the 1 MiB sample as line objects and one document, not the 90 MB stream.
    print(f"streamed {streamed / 1e6:.0f} MB in {seconds:.1f} s, peak {peak / 2**20:.1f} MiB")
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    # About 10 s here under tracemalloc; only a pathological (e.g. quadratic) pass would come near this.
    assert seconds < 120, f"{seconds:.0f} s"
