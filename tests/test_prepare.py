"""`lmlab prepare`: the same tokens as before for one document, a deterministic document split,
results independent of the number of workers, byte-identical shards after an interrupt (in either
stage, and after kill -9), loss masks for records, and bad input reported on one line with nothing
left in the cache that a later run could take for complete."""

import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from lmlab import manifest
from lmlab.api import Tokenizer
from lmlab.cli.main import main
from lmlab.prepare import pipeline
from lmlab.prepare.shards import ShardedTokens
from lmlab.prepare import tokens as token_cache
from lmlab.train.batches import FixedWindows, RandomWindows
from support import ROOT, StopAfter

ENCODINGS = Path(sysconfig.get_paths()["stdlib"]) / "encodings"
needs_stdlib = pytest.mark.skipif(not ENCODINGS.is_dir(), reason="no standard library sources here")
FILTERS = """
[filter]
use = ["pii-scrub", "timestamp-mask", "exact-dedup", "minhash-dedup"]
"""


def write_manifest(tmp_path: Path, data: str, extra: str = "", tokenizer: str = "char") -> Path:
    path = tmp_path / "prep.toml"
    path.write_text(f'name = "prep"\n\n[data]\n{data}\n\n[tokenizer]\nuse = "{tokenizer}"\n\n'
                    f'[tracker]\nuse = "none"\n{extra}')
    return path


def variant_of(path: Path, *overrides: str):
    (variant,) = manifest.load(path, list(overrides))
    return variant


def encodings_manifest(tmp_path: Path) -> Path:
    return write_manifest(tmp_path, f'use = "text-file"\npath = "{ENCODINGS}/*.py"', FILTERS, tokenizer="byte")


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def quiet(event: str, info: dict) -> None:
    pass


def test_one_document_gives_the_char_arrays_of_nanogpts_split(tmp_path, corpus_slice):
    # What training saw before sharding (and what nanoGPT's prepare.py computes): the vocabulary of
    # the first 90 % of the characters, and the two parts encoded without any separator.
    variant = variant_of(write_manifest(tmp_path, f'use = "text-file"\npath = "{corpus_slice}"'))
    data = token_cache.load_tokens(variant, root=tmp_path / "cache")
    text = corpus_slice.read_text()
    cut = int(len(text) * 0.9)
    chars = np.array(sorted(set(text[:cut])))
    codes = np.array([ord(c) for c in chars])
    expected = {part: np.searchsorted(codes, [ord(c) for c in piece]) for part, piece in
                (("train", text[:cut]), ("val", text[cut:]))}
    for split in ("train", "val"):
        array = getattr(data, split)
        assert array.dtype == np.uint16 and isinstance(array, np.memmap)
        np.testing.assert_array_equal(np.asarray(array), expected[split])
    assert data.index["split"] == "characters" and data.index["documents"] == {"train": 1, "val": 1}


def test_documents_go_to_validation_evenly_and_deterministically(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i:02d}|"}) + "\n" for i in range(25)))
    variant = variant_of(write_manifest(tmp_path, f'use = "jsonl"\npath = "{corpus}"', tokenizer="byte"))
    data = token_cache.load_tokens(variant, root=tmp_path / "cache")
    assert data.index["documents"] == {"train": 23, "val": 2}  # floor(25 * 0.1) = 2: the 10th and 20th
    assert data.tokenizer.decode(np.asarray(data.val)) == "doc 09|doc 19|"
    np.testing.assert_array_equal(data.document_starts("val"), [0, 7])


def test_the_last_document_is_held_out_when_no_other_was(tmp_path):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("ab", "ba", "aab")))
    variant = variant_of(write_manifest(tmp_path, f'use = "jsonl"\npath = "{corpus}"'))
    data = token_cache.load_tokens(variant, root=tmp_path / "cache")
    assert data.tokenizer.decode(np.asarray(data.val)) == "aab"


@needs_stdlib
def test_one_worker_or_two_give_byte_identical_shards(tmp_path):
    variant = variant_of(encodings_manifest(tmp_path))
    one = pipeline.prepare_corpus(variant, root=tmp_path / "one", workers=1, shard_mb=0.25, listener=quiet)
    two = pipeline.prepare_corpus(variant, root=tmp_path / "two", workers=2, shard_mb=0.25, listener=quiet)
    assert files_of(one) == files_of(two)
    index = json.loads((one / "index.json").read_text())
    assert len(index["shards"]["train"]) > 1
    assert index["filters"]["minhash-dedup"]["documents_dropped"] > 0  # the cp* family


@needs_stdlib
@pytest.mark.parametrize("stage_event", ["part", "shard"])  # interrupted while filtering / tokenising
def test_an_interrupted_prepare_resumes_to_byte_identical_shards(tmp_path, stage_event):
    variant = variant_of(encodings_manifest(tmp_path))
    whole = []
    reference = pipeline.prepare_corpus(variant, root=tmp_path / "reference", workers=1, shard_mb=0.1,
                                 listener=lambda e, i: whole.append(e))
    root = tmp_path / "interrupted"
    with pytest.raises(KeyboardInterrupt):
        pipeline.prepare_corpus(variant, root=root, workers=1, shard_mb=0.1, listener=StopAfter(stage_event, 3))
    assert not (root / "tokens").exists() and (root / "partial" / reference.name / "state.json").is_file()
    if stage_event == "part":  # the dedup filters' state is checkpointed as arrays, never pickled
        assert [p.suffix for p in (root / "partial" / reference.name).glob("filters-*")] == [".npz"]
    events = []
    resumed = pipeline.prepare_corpus(variant, root=root, workers=1, listener=lambda e, i: events.append((e, i)))
    assert events[0][0] == "resume" and events[0][1]["stage"] == ("filter" if stage_event == "part" else "tokenize")
    # what was finished before the interrupt is kept, not done again
    assert sum(e == stage_event for e, _ in events) == whole.count(stage_event) - 3
    assert files_of(resumed) == files_of(reference)
    assert not (root / "partial" / reference.name).exists()


def kill_a_few_parts_in(command: list[str], env: dict, root: Path, parts: int = 3) -> None:
    """Start ``lmlab prepare`` (``command``) on the cache ``root`` and kill -9 it, with every process
    it started (its own session, as a job's end would), once ``parts`` text parts are checkpointed."""
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        states = list(root.glob("partial/*/state.json"))
        try:
            if states and len(json.loads(states[0].read_text())["parts"]) >= parts:
                break
        except (json.JSONDecodeError, OSError):
            pass
        time.sleep(0.02)
    assert process.poll() is None, "the preparation ended before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@needs_stdlib
def test_a_prepare_killed_with_sigkill_resumes_to_byte_identical_shards(tmp_path):
    path = encodings_manifest(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "lmlab", "prepare", str(path), "--workers", "1", "--shard-mb", "0.05"]
    reference = subprocess.run(command, env={**env, "LMLAB_CACHE": str(tmp_path / "reference")},
                               capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stderr
    root = tmp_path / "killed"
    kill_a_few_parts_in(command, {**env, "LMLAB_CACHE": str(root)}, root)
    resumed = subprocess.run(command, env={**env, "LMLAB_CACHE": str(root)}, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming an interrupted preparation" in resumed.stderr
    (done,) = (root / "tokens").iterdir()
    assert files_of(done) == files_of(tmp_path / "reference" / "tokens" / done.name)


def test_records_get_a_loss_mask_that_scores_responses_and_end_of_document(tmp_path):
    corpus = tmp_path / "data.jsonl"
    corpus.write_text("".join(json.dumps({"instruction": f"say {i % 5}", "output": f"ok {i % 5}"}) + "\n" for i in range(20)))
    variant = variant_of(write_manifest(tmp_path, f'use = "alpaca"\npath = "{corpus}"\n'
                                                  'prompt_template_no_input = "{instruction}: "'))
    data = token_cache.load_tokens(variant, root=tmp_path / "cache")
    assert data.index["masked"] and data.train_mask is not None and data.train_mask.dtype == np.uint8
    first = data.tokenizer.decode(np.asarray(data.train[:11]))
    assert first == "say 0: ok 0"  # no eos with the char tokenizer: documents simply follow each other
    np.testing.assert_array_equal(np.asarray(data.train_mask[:11]), [0] * 7 + [1] * 4)
    assert len(data.train_mask) == len(data.train) and len(data.val_mask) == len(data.val)


class EndOfText(Tokenizer):
    """Bytes, with 256 as the end-of-document id: shows where the pipeline puts it."""

    name = "end-of-text"

    @property
    def vocab_size(self) -> int:
        return 257

    @property
    def eos_id(self) -> int:
        return 256

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode()


def test_the_end_of_document_token_follows_every_document_and_is_scored(tmp_path):
    corpus = tmp_path / "data.jsonl"
    corpus.write_text("".join(json.dumps({"instruction": "q", "output": "a"}) + "\n" for i in range(10)))
    variant = variant_of(write_manifest(tmp_path, f'use = "alpaca"\npath = "{corpus}"\n'
                                                  'prompt_template_no_input = "{instruction}="'))
    variant = variant.with_plugin("tokenizer", EndOfText)
    data = token_cache.load_tokens(variant, root=tmp_path / "cache")
    assert data.index["dtype"] == "uint16"
    np.testing.assert_array_equal(np.asarray(data.train[:6]), [ord("q"), ord("="), ord("a"), 256, ord("q"), ord("=")])
    np.testing.assert_array_equal(np.asarray(data.train_mask[:6]), [0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(data.document_starts("train")[:3], [0, 4, 8])


def test_tokenizers_without_a_streaming_fit_are_fitted_on_the_joined_training_documents():
    class Recording(Tokenizer):
        def fit(self, text, workdir):
            self.seen = text

    tokenizer = Recording()
    tokenizer.fit_documents(iter(["a", "b"]), Path("."))
    assert tokenizer.seen == "a\nb"


def test_sharded_tokens_index_like_their_concatenation():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 60000, size=n).astype(np.uint16) for n in (5, 1, 30, 7)]
    whole, sharded = np.concatenate(parts), ShardedTokens(parts)
    assert len(sharded) == len(whole)
    index = rng.integers(0, len(whole), size=(6, 9))
    np.testing.assert_array_equal(sharded[index], whole[index])
    for start, stop in ((0, 43), (3, 8), (5, 6), (4, 40), (40, 40)):
        np.testing.assert_array_equal(sharded[start:stop], whole[start:stop])
    assert sharded[-1] == whole[-1] and sharded[5] == whole[5]
    np.testing.assert_array_equal(sharded.astype(np.int64), whole.astype(np.int64))
    # the training and validation windows are the same over shards as over one array
    a, b = RandomWindows(sharded, 8, 4, seed=1), RandomWindows(whole, 8, 4, seed=1)
    assert all(np.array_equal(a.batch(i).numpy(), b.batch(i).numpy()) for i in range(5))
    assert all(np.array_equal(FixedWindows(sharded, 8)[i].numpy(), FixedWindows(whole, 8)[i].numpy())
               for i in range(len(FixedWindows(whole, 8))))


def test_a_second_builder_waits_for_the_first(tmp_path, corpus_slice):
    variant = variant_of(write_manifest(tmp_path, f'use = "text-file"\npath = "{corpus_slice}"'))
    root = tmp_path / "cache"
    key = pipeline.cache_key(variant)
    (root / "partial").mkdir(parents=True)
    events, results = [], []
    with open(root / "partial" / f"{key}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: results.append(
            pipeline.prepare_corpus(variant, root=root, listener=lambda e, i: events.append(e))))
        worker.start()
        for _ in range(500):
            if "wait" in events:
                break
            time.sleep(0.01)
        assert events == ["wait"]
        fcntl.flock(held, fcntl.LOCK_UN)
    worker.join(60)
    assert results and (results[0] / "index.json").is_file()


# -- bad input: one line, exit 2, nothing left behind --------------------------------------------------

def prepare_cli(path: Path, capsys, *args: str) -> tuple[int, str]:
    code = main(["prepare", str(path), "--workers", "1", *args])
    return code, capsys.readouterr().err


def assert_nothing_cached(root: Path) -> None:
    assert not (root / "tokens").exists() or not any((root / "tokens").iterdir())
    assert not any(p.is_dir() for p in (root / "partial").iterdir())


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LMLAB_CACHE", str(root))
    return root


@pytest.mark.parametrize("content, message", [
    ("", "data: the corpus is empty: the data source yielded no documents"),
    ("x", "data.val_fraction: the corpus is one document of 1 character, too short"),
])
def test_a_corpus_too_small_to_split_is_bad_input(tmp_path, capsys, cache, content, message):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(content)
    code, err = prepare_cli(write_manifest(tmp_path, f'use = "text-file"\npath = "{corpus}"'), capsys)
    assert code == 2 and err.startswith(f"lmlab: error: {message}") and err.count("\n") == 1
    assert_nothing_cached(cache)


def test_a_file_that_cannot_be_decoded_is_bad_input_naming_it(tmp_path, capsys, cache):
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe\xfa broken")
    code, err = prepare_cli(write_manifest(tmp_path, f'use = "text-file"\npath = "{tmp_path}/*.txt"'), capsys)
    assert code == 2 and "b.txt is not valid utf-8" in err and err.count("\n") == 1
    assert_nothing_cached(cache)


def test_a_jsonl_line_that_is_not_json_fails_naming_file_and_line_or_is_skipped(tmp_path, capsys, cache):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(12)) + "{oops\n")
    path = write_manifest(tmp_path, f'use = "jsonl"\npath = "{corpus}"', tokenizer="byte")
    code, err = prepare_cli(path, capsys)
    assert code == 2 and f"data.path: {corpus}:13: not JSON" in err and err.count("\n") == 1
    assert_nothing_cached(cache)
    code, err = prepare_cli(path, capsys, "--set", 'data.bad_line="skip"')
    assert code == 0 and "data: lines_skipped 1" in err


def test_filters_that_drop_every_document_are_bad_input(tmp_path, capsys, cache):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": "same"}) + "\n" for _ in range(5)))
    code, err = prepare_cli(write_manifest(tmp_path, f'use = "jsonl"\npath = "{corpus}"',
                                           '[filter]\nuse = ["quality"]\n'), capsys)
    assert code == 2 and "filter.use: the filters dropped all 5 documents (quality dropped 5)" in err
    assert_nothing_cached(cache)


def test_prepare_reports_an_entry_that_is_already_there(tmp_path, capsys, cache, corpus_slice):
    path = write_manifest(tmp_path, f'use = "text-file"\npath = "{corpus_slice}"')
    assert prepare_cli(path, capsys)[0] == 0
    assert main(["prepare", str(path)]) == 0
    assert "(already prepared)" in capsys.readouterr().out


def test_a_run_records_what_each_filter_kept_and_dropped(tmp_path, tiny_manifest):
    corpus = tmp_path / "plays.jsonl"
    lines = (ROOT / "data" / "tinyshakespeare.txt").read_text()[:40_000].split("\n\n")
    lines[8] += " (write to will@globe.example.com)"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines + lines[:5]))
    path = tiny_manifest(FILTERS, steps=2, eval_every=2)
    path.write_text(path.read_text().replace('use = "text-file"', 'use = "jsonl"').replace("tiny.txt", corpus.name))
    out = tmp_path / "runs"
    assert main(["run", str(path), "--out", str(out), "--set", "train.sample_tokens=0"]) == 0
    summary = json.loads((out / "default" / "summary.json").read_text())
    filters = summary["data_filters"]
    assert list(filters) == ["pii-scrub", "timestamp-mask", "exact-dedup", "minhash-dedup"]
    assert filters["pii-scrub"]["counts"] == {"email": 1} and filters["pii-scrub"]["documents_changed"] == 1
    assert filters["exact-dedup"]["documents_dropped"] == 5
    assert sum(summary["data"]["documents"].values()) == filters["minhash-dedup"]["documents_kept"]


def test_the_cache_key_changes_with_the_tokenizer_plugins_version(tmp_path, corpus_slice, monkeypatch):
    """A new release of a plugin may tokenize differently: its tokens are not the old release's."""
    from lmlab import discovery

    variant = variant_of(write_manifest(tmp_path, f'use = "text-file"\npath = "{corpus_slice}"'))
    before = pipeline.cache_key(variant)
    assert pipeline.cache_key(variant) == before
    find = discovery.find

    def newer(slot, name, **kwargs):
        info = find(slot, name, **kwargs)
        if slot == "tokenizer":
            info = dataclasses.replace(info, version=info.version + ".post1")
        return info

    monkeypatch.setattr(discovery, "find", newer)
    assert pipeline.cache_key(variant) != before


def test_the_cache_key_changes_when_the_hf_tokenizer_file_at_the_same_path_does(tmp_path, corpus_slice):
    """Options alone do not say which tokenizer.json a path held: its contents are in the key."""
    from tokenizers import Tokenizer as FastTokenizer, models

    folder = tmp_path / "hf"
    folder.mkdir()

    def save(vocab):
        FastTokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(folder / "tokenizer.json"))

    save({"<unk>": 0, "a": 1})
    path = tmp_path / "hf.toml"
    path.write_text(f'name = "hf"\n[data]\nuse = "text-file"\npath = "{corpus_slice}"\n'
                    f'[tokenizer]\nuse = "hf"\npath = "{folder}"\n[tracker]\nuse = "none"\n')
    variant = variant_of(path)
    before = pipeline.cache_key(variant)
    assert pipeline.cache_key(variant) == before
    save({"<unk>": 0, "b": 1})
    assert pipeline.cache_key(variant) != before


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1"])
def test_a_shard_size_that_is_not_a_positive_number_is_one_line_and_exit_2(tmp_path, value):
    from support import refused, run_cli

    (tmp_path / "a.txt").write_text("hello world\n" * 100)
    path = write_manifest(tmp_path, f'use = "text-file"\npath = "{tmp_path / "a.txt"}"')
    result = run_cli("prepare", str(path), f"--shard-mb={value}", env={"LMLAB_CACHE": str(tmp_path / "cache")})
    assert "positive number of MB" in refused(result, "--shard-mb")
    assert not (tmp_path / "cache").exists()
