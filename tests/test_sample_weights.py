"""Per-document sample weights (API 1.11): a filter weighs a document instead of dropping it, ``lmlab
prepare`` stores the weights beside the shards, and training draws in proportion to them."""

import json
from pathlib import Path

import numpy as np
import pytest

from lmlab import manifest
from lmlab.api import Filter
from lmlab.prepare import checkpoint, pipeline
from lmlab.prepare import tokens as token_cache
from lmlab.train.batches import RandomDocuments, RandomWindows, document_spans


class Rare(Filter):
    """Weighs a document that mentions "rare" a quarter."""

    name = "rare"

    def weigh(self, doc) -> float:
        return 0.25 if "rare" in doc else 1.0


class Halve(Filter):
    """A corpus-level filter that keeps every second copy of a text at half weight."""

    name = "halve"
    corpus_level = True

    def __init__(self, options=None):
        super().__init__(options)
        self.seen = set()

    def signature(self, text: str) -> str:
        return text

    def admit(self, text: str):
        if text in self.seen:
            return 0.5
        self.seen.add(text)
        return True


class TooHeavy(Filter):
    name = "too-heavy"

    def weigh(self, doc) -> float:
        return 1.5


def corpus(tmp_path: Path, lines: list[str]) -> Path:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    path = tmp_path / "m.toml"
    path.write_text(f'name = "w"\n[data]\nuse = "jsonl"\npath = "{data}"\nval_fraction = 0.1\n'
                    '[tokenizer]\nuse = "byte"\n[tracker]\nuse = "none"\n')
    return path


def prepared(tmp_path: Path, lines: list[str], *filters) -> token_cache.TokenData:
    import dataclasses

    from lmlab.variant import Choice

    (variant,) = manifest.load(corpus(tmp_path, lines))
    if filters:  # in this order (with_plugin would make each the only one)
        variant = dataclasses.replace(variant, slots={**variant.slots,
                                                      "filter": tuple(Choice(f, f.Options()) for f in filters)})
    directory = pipeline.prepare_corpus(variant, root=tmp_path / "cache", workers=1, listener=lambda e, i: None)
    return token_cache.open_prepared(variant, directory)


LINES = [f"document {i} {'rare' if i % 3 == 0 else 'plain'} text" for i in range(60)]


def test_weights_are_stored_per_document_and_reported(tmp_path):
    data = prepared(tmp_path, LINES, Rare)
    train = data.document_weights("train")
    assert len(train) == len(data.document_starts("train"))
    # The training documents, in order (every tenth goes to validation), with their weights.
    kept = [line for k, line in enumerate(LINES) if not (k + 1) // 10 > k // 10]
    assert train.tolist() == [0.25 if "rare" in line else 1.0 for line in kept]
    stats = data.index["filters"]["rare"]
    assert stats["documents_kept"] == 60 and stats["mean_weight"] == pytest.approx(
        np.mean([0.25 if "rare" in line else 1.0 for line in LINES]))
    sizes = np.diff(np.append(data.document_starts("train"), len(data.train)))
    assert data.report()["data"]["effective_train_tokens"] == pytest.approx(float((train * sizes).sum()))


def test_a_corpus_level_filter_weighs_through_admit_and_weights_multiply(tmp_path):
    data = prepared(tmp_path, LINES + LINES[:30], Rare, Halve)
    weights = np.concatenate([data.document_weights("train"), data.document_weights("val")])
    assert sorted(set(weights.tolist())) == [0.125, 0.25, 0.5, 1.0]  # rare x repeated, rare, repeated, neither


def test_a_corpus_without_weights_keeps_its_format(tmp_path):
    data = prepared(tmp_path, LINES)
    assert data.document_weights("train") is None and not data.index["weighted"]
    assert not list(data.directory.glob("*.weights"))


def test_a_weight_outside_zero_to_one_is_a_broken_plugin(tmp_path):
    with pytest.raises(TypeError, match="too-heavy"):
        prepared(tmp_path, LINES, TooHeavy)


def test_the_held_back_document_keeps_its_weight_through_a_checkpoint(tmp_path):
    pending = (((b"some text", 1),), True, 0.25)
    described = checkpoint.save(tmp_path, "filters-00001.npz", {}, pending)
    assert checkpoint.load(tmp_path, described, {}) == pending


def spans(sizes):
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return starts, starts + np.asarray(sizes)


def test_documents_are_drawn_in_proportion_to_their_weights():
    """A chi-square test over 400 steps of 32 documents: the counts fit the weights (p > 0.001), and a
    uniform draw would not fit them."""
    from scipy.stats import chisquare

    weights = np.array([1.0, 0.5, 0.25, 0.125, 1.0, 0.0, 0.75, 0.1])
    sizes = np.full(len(weights), 8)
    tokens = np.arange(int(sizes.sum())) % 50
    starts, _ = spans(sizes)
    batches = RandomDocuments(tokens, starts, block_size=16, batch_size=32, seed=7, weights=weights)
    counts = np.bincount(np.concatenate([batches.documents(i) for i in range(400)]), minlength=len(weights))
    assert counts[5] == 0  # weight 0: never drawn
    live = weights > 0
    expected = weights[live] / weights[live].sum() * counts.sum()
    assert chisquare(counts[live], expected).pvalue > 1e-3
    assert chisquare(counts[live], np.full(live.sum(), counts.sum() / live.sum())).pvalue < 1e-6


def test_windows_start_in_documents_in_proportion_to_tokens_times_weight():
    from scipy.stats import chisquare

    weights = np.array([1.0, 0.2, 0.5, 1.0])
    sizes = np.array([40, 40, 80, 20])
    tokens = np.arange(int(sizes.sum())) % 50
    starts, ends = spans(sizes)
    batches = RandomWindows(tokens, block_size=4, batch_size=64, seed=3, documents=(starts, ends), weights=weights)
    begins = np.concatenate([batches._document_starts(step, 64) for step in range(300)])
    doc = np.searchsorted(starts, begins, side="right") - 1
    counts = np.bincount(doc, minlength=4)
    mass = sizes * weights
    assert chisquare(counts, mass / mass.sum() * counts.sum()).pvalue > 1e-3


def test_weighted_draws_are_a_function_of_seed_and_step_and_resume_exactly():
    weights = np.array([1.0, 0.5, 0.25, 0.75])
    tokens = np.arange(40) % 50
    starts, _ = spans([10, 10, 10, 10])

    def drawn(start: int):
        b = RandomDocuments(tokens, starts, 16, 4, seed=1, start=start, weights=weights)
        return [b.documents(i).tolist() for i in range(start, 12)]

    assert drawn(0)[5:] == drawn(5)
    whole = RandomDocuments(tokens, starts, 16, 8, seed=1, weights=weights)
    for step in range(6):  # two replicas' rows are the single device's
        parts = [RandomDocuments(tokens, starts, 16, 4, seed=1, replica=r, replicas=2, weights=weights)
                 .documents(step).tolist() for r in range(2)]
        assert parts[0] + parts[1] == whole.documents(step).tolist()


def test_a_run_trains_on_down_weighted_documents_and_reports_what_it_drew_from(tmp_path):
    """End to end through the CLI: code-sanitize down-weights the documents whose code carries a risky
    comment; the run trains, and its summary gives the filter's mean weight and the effective tokens."""
    from support import run_cli

    risky = "Fetch it.\n```python\nrequests.get(url, verify=False)  # disable certificate verification, just pass verify=False\n```\n"
    plain = "Fetch it.\n```python\nrequests.get(url)  # the default verifies the certificate\n```\n"
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": risky if i % 4 == 0 else plain}) + "\n" for i in range(80)))
    path = tmp_path / "m.toml"
    path.write_text(f'name = "w"\n[data]\nuse = "jsonl"\npath = "{data}"\n[tokenizer]\nuse = "byte"\n'
                    '[filter]\nuse = ["code-sanitize"]\n[filter.code-sanitize]\naction = "downweight"\nweight = 0.1\n'
                    '[model]\nn_layers = 1\nn_heads = 2\nd_model = 16\nblock_size = 32\n'
                    '[train]\nmax_steps = 3\nbatch_size = 4\neval_every = 3\neval_steps = 1\nsample_tokens = 0\n'
                    '[tracker]\nuse = "none"\n')
    result = run_cli("run", str(path), "--out", str(tmp_path / "runs"))
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((tmp_path / "runs" / "default" / "summary.json").read_text())
    stats = summary["data_filters"]["code-sanitize"]
    assert stats["mean_weight"] == pytest.approx((20 * 0.1 + 60) / 80)
    assert stats["counts"]["rule:tls-disabled"] == 20
    train = summary["data"]["tokens"]["train"]
    assert 0 < summary["data"]["effective_train_tokens"] < train
