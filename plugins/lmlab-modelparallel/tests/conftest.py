"""Fixtures the model-parallel tests share: a tiny manifest for a [parallel] table, the CLI, and what
a run stopped by bad input must look like."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmlab.testing.parallel import MANIFEST, synthetic_corpus


@pytest.fixture
def manifest(tmp_path):
    """manifest(parallel_table, extra="", steps=2) → the path of a tiny manifest with that [parallel] table."""

    def write(parallel_table: str, extra: str = "", steps: int = 2) -> Path:
        corpus = synthetic_corpus(tmp_path / "corpus.txt", size=20_000)
        path = tmp_path / "run.toml"
        path.write_text(MANIFEST.format(data=corpus, steps=steps, batch_size=4) + extra
                        + f"\n[parallel]\n{parallel_table}\n")
        return path

    return write


@pytest.fixture
def lmlab(tmp_path):
    """lmlab(*args) → the finished ``python -m lmlab`` process, one thread per process."""

    def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LMLAB_CACHE": str(tmp_path / "cache")}
        return subprocess.run([sys.executable, "-m", "lmlab", *args], capture_output=True, text=True, env=env,
                              timeout=timeout)

    return run


def refused(result: subprocess.CompletedProcess, key: str) -> str:
    """The error line of a run stopped by bad input: exit 2, no traceback, one error line naming ``key``."""
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("lmlab: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"lmlab: error: {key}:"), result.stderr
    return errors[0]


@pytest.fixture(name="refused")
def refused_fixture():
    return refused


@pytest.fixture
def toy_model():
    """toy_model(n_layers, tied=True) → a module shaped as lmlab's model (tok_emb, position, blocks of
    attn and ffn, norm_f, head), for layouts that read its structure: 100 parameters per attention,
    200 per ffn, 1000 in the embedding."""
    from torch import nn

    def build(n_layers: int = 4, tied: bool = True):
        model = nn.Module()
        model.tok_emb = nn.Embedding(100, 10)
        model.position = nn.Module()
        model.blocks = nn.ModuleList()
        for _ in range(n_layers):
            block = nn.Module()
            block.attn, block.ffn = nn.Linear(10, 10, bias=False), nn.Linear(10, 20, bias=False)
            model.blocks.append(block)
        model.norm_f = nn.Module()
        model.head = nn.Linear(10, 100, bias=False)
        if tied:
            model.head.weight = model.tok_emb.weight
        return model

    return build
