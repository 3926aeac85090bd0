from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "data" / "tinyshakespeare.txt"


@pytest.fixture
def corpus_slice(tmp_path) -> Path:
    """The first 60 kB of tinyshakespeare: enough to train a few steps, fast to tokenise."""
    path = tmp_path / "tiny.txt"
    path.write_text(CORPUS.read_text()[:60_000])
    return path


def tiny_toml(data: str, *, name: str = "tiny", seed: int = 3, steps: int = 6, batch_size: int = 4,
              warmup_steps: int = 2, eval_every: int = 3, checkpoint_every: int = 3, sample_tokens: int = 8) -> str:
    """A tiny, fast manifest (2 layers of width 32, block 16) training on ``data``; append tables to it."""
    return f"""
name = "{name}"
seed = {seed}

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
batch_size = {batch_size}
warmup_steps = {warmup_steps}
eval_every = {eval_every}
eval_steps = 2
checkpoint_every = {checkpoint_every}
log_every = 2
sample_tokens = {sample_tokens}

[tracker]
use = "none"
"""


@pytest.fixture
def tiny_manifest(tmp_path, corpus_slice):
    """Writes a tiny, fast manifest (optionally with extra TOML appended) and returns its path."""

    def write(extra: str = "", steps: int = 6, eval_every: int = 3, checkpoint_every: int = 3,
              name: str = "tiny.toml") -> Path:
        path = tmp_path / name
        path.write_text(tiny_toml(corpus_slice.name, steps=steps, eval_every=eval_every,
                                  checkpoint_every=checkpoint_every) + extra)
        return path

    return write


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> Path:
    """A completed 6-step tiny run folder, trained once per session; copy it (``run_copy``) to change it."""
    from support import run_cli

    root = tmp_path_factory.mktemp("trained")
    (root / "tiny.txt").write_text(CORPUS.read_text()[:60_000])
    (root / "tiny.toml").write_text(tiny_toml("tiny.txt", steps=6))
    done = run_cli("run", str(root / "tiny.toml"), "--out", str(root / "runs"),
                   env={"LMLAB_CACHE": str(root / "cache"), "WANDB_MODE": "offline"})
    assert done.returncode == 0, done.stderr[-2000:]
    return root / "runs" / "default"


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    """A private copy of :func:`trained_run`'s folder."""
    import shutil

    return Path(shutil.copytree(trained_run, tmp_path / "default"))
