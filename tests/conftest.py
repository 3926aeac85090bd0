from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "tinyshakespeare.txt"


@pytest.fixture(autouse=True)
def _isolated(tmp_path_factory, monkeypatch):
    # One token cache for the session (tokenising is shared), offline W&B, no network anywhere.
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path_factory.getbasetemp() / "lmlab-cache"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture
def corpus_slice(tmp_path) -> Path:
    """The first 60 kB of tinyshakespeare: enough to train a few steps, fast to tokenise."""
    path = tmp_path / "tiny.txt"
    path.write_text(CORPUS.read_text()[:60_000])
    return path


TINY = """
name = "tiny"
seed = 3

[data]
use = "text-file"
path = "{data}"

[model]
n_layers = 2
d_model = 32
n_heads = 4
block_size = 16

[train]
max_steps = {steps}
batch_size = 4
warmup_steps = 2
eval_every = {eval_every}
eval_steps = 2
checkpoint_every = {checkpoint_every}
log_every = 2
sample_tokens = 8

[tracker]
use = "none"
"""


@pytest.fixture
def tiny_manifest(tmp_path, corpus_slice):
    """Writes a tiny, fast manifest (optionally with extra TOML appended) and returns its path."""

    def write(extra: str = "", steps: int = 6, eval_every: int = 3, checkpoint_every: int = 3,
              name: str = "tiny.toml") -> Path:
        path = tmp_path / name
        path.write_text(TINY.format(data=corpus_slice.name, steps=steps, eval_every=eval_every,
                                    checkpoint_every=checkpoint_every) + extra)
        return path

    return write
