"""Through the real CLI: a vocabulary the corpus cannot support is bad input that leaves nothing in the
token cache; the fitted model does not depend on the number of workers; and a tiny model trains on a
corpus tokenised with user-defined symbols and an end-of-document token between documents."""

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from lmlab_sentencepiece.sentencepiece import MODEL_FILE, SentencePieceTokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])

MANIFEST = """
name = "sp"
seed = 1

[data]
{data}

[tokenizer]
use = "sentencepiece"
{tokenizer}

[model]
n_layers = 2
d_model = 32
n_heads = 4
block_size = 32

[optimizer]
use = "adamw"
lr = 1e-2

[train]
max_steps = 30
batch_size = 8
warmup_steps = 0
eval_every = 30
eval_steps = 2
checkpoint_every = 30
log_every = 5
sample_tokens = 0

[tracker]
use = "none"
"""


def lmlab(*args, cache: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMLAB_CACHE": str(cache), "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", "lmlab", *args], capture_output=True, text=True, env=env, timeout=300)


def write_manifest(folder: Path, data: str, tokenizer: str) -> Path:
    path = folder / "sp.toml"
    path.write_text(MANIFEST.format(data=data, tokenizer=tokenizer))
    return path


def finished_entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("tokens/*/index.json"))


def genes_corpus(folder: Path, n: int = 60) -> Path:
    """JSONL documents that each name BRCA1 exactly once, in varied contexts."""
    contexts = ["The BRCA1 gene", "BRCA1-mutated cells", "loss of (BRCA1) function", "xBRCA1y", "BRCA1, TP53"]
    lines = [json.dumps({"text": f"Case {i}: {contexts[i % 5]} was sequenced; the patient had no other finding.\n"
                                 f"Follow-up in {1990 + i}."}) for i in range(n)]
    path = folder / "genes.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_vocabulary_too_large_is_bad_input_that_leaves_no_cache_entry(tmp_path):
    corpus = genes_corpus(tmp_path)
    cache = tmp_path / "cache"
    path = write_manifest(tmp_path, f'use = "jsonl"\npath = "{corpus}"', "vocab_size = 5000")
    for command in (["prepare", str(path), "--workers", "1"], ["run", str(path), "--out", str(tmp_path / "runs")]):
        result = lmlab(*command, cache=cache)
        assert result.returncode == 2, result.stderr[-2000:]
        (line,) = result.stderr.strip().splitlines()[-1:]
        assert line.startswith("lmlab: error: tokenizer.vocab_size: 5000 pieces are more than the training "
                               "split supports with model_type = 'bpe'; the largest workable value is ")
        assert "Traceback" not in result.stderr and result.stderr.count("lmlab: error") == 1
        assert finished_entries(cache) == []
        assert not list((cache / "tokens").glob("*")) and not [p for p in (cache / "partial").iterdir() if p.is_dir()]
    largest = int(line.rsplit(" ", 1)[-1])
    path.write_text(path.read_text().replace("vocab_size = 5000", f"vocab_size = {largest}"))
    result = lmlab("prepare", str(path), "--workers", "1", cache=cache)
    assert result.returncode == 0, result.stderr[-2000:]
    (index,) = finished_entries(cache)
    assert json.loads(index.read_text())["vocab_size"] == largest


@pytest.mark.skipif(not any(STDLIB.glob("[a-c]*.py")), reason="no standard library sources here")
def test_the_fitted_model_and_shards_do_not_depend_on_the_number_of_workers(tmp_path):
    # The standard library's modules (a real corpus, one document per file), sampled to 0.2 MiB.
    path = write_manifest(tmp_path, f'use = "text-file"\npath = "{STDLIB}/[a-c]*.py"',
                          'model_type = "unigram"\nvocab_size = 800\nbyte_fallback = true\nsample_mb = 0.2')
    folders = []
    for workers in ("1", "2"):
        cache = tmp_path / f"cache-{workers}"
        result = lmlab("prepare", str(path), "--workers", workers, "--shard-mb", "0.25", cache=cache)
        assert result.returncode == 0, result.stderr[-2000:]
        (index,) = finished_entries(cache)
        folders.append(index.parent)
    one, two = ({p.relative_to(f).as_posix(): p.read_bytes() for p in sorted(f.rglob("*")) if p.is_file()}
                for f in folders)
    assert one == two and f"tokenizer/{MODEL_FILE}" in one and len([n for n in one if n.endswith(".bin")]) > 2


def test_a_tiny_model_trains_on_text_with_user_defined_symbols_and_document_ends(tmp_path):
    corpus = genes_corpus(tmp_path)
    cache = tmp_path / "cache"
    path = write_manifest(tmp_path, f'use = "jsonl"\npath = "{corpus}"',
                          'vocab_size = 120\nuser_defined_symbols = ["BRCA1", "TP53"]')
    result = lmlab("run", str(path), "--out", str(tmp_path / "runs"), cache=cache)
    assert result.returncode == 0, result.stderr[-2000:]
    (summary_path,) = (tmp_path / "runs").rglob("summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["plugins"]["tokenizer"]["name"] == "sentencepiece"
    losses = [r["train_loss"] for r in map(json.loads, (summary_path.parent / "metrics.jsonl").read_text().splitlines())
              if "train_loss" in r]
    assert losses[-1] < losses[0] - 1.0  # it learns (ln 120 ≈ 4.8 at the start)

    # The run's tokenizer keeps the symbols whole, and the prepared tokens hold exactly one BRCA1 and one
    # end-of-document token per document.
    tok = SentencePieceTokenizer(SentencePieceTokenizer.Options())
    tok.load(summary_path.parent / "tokenizer")
    brca1, tp53 = tok.token_id("BRCA1"), tok.token_id("TP53")
    assert tok.encode("xBRCA1y")[1] == brca1 and len(tok.encode("BRCA1, TP53")) == 4
    (index_path,) = finished_entries(cache)
    index = json.loads(index_path.read_text())
    tp53_seen = 0
    for split in ("train", "val"):
        ids = np.concatenate([np.fromfile(index_path.parent / f"{s['name']}.bin", dtype=index["dtype"])
                              for s in index["shards"][split]])
        documents = index["documents"][split]
        assert documents > 0 and index["eos_id"] == tok.eos_id == 1
        assert (ids == tok.eos_id).sum() == documents and ids[-1] == tok.eos_id
        assert (ids == brca1).sum() == documents
        assert (ids == tok.pad_id).sum() == 0
        tp53_seen += (ids == tp53).sum()
    assert tp53_seen == 60 // 5
