"""A tiny run to watch: 2 layers of width 32 on the first 60 kB of tinyshakespeare, a few steps."""

from pathlib import Path

import pytest
import torch

CORPUS = Path(__file__).resolve().parents[3] / "data" / "tinyshakespeare.txt"


@pytest.fixture
def tiny_manifest(tmp_path):
    """Writes a tiny manifest with ``extra`` TOML appended (monitor tables, [train] overrides go in
    ``train``) and returns its path."""
    corpus = tmp_path / "tiny.txt"
    corpus.write_text(CORPUS.read_text()[:60_000])

    def write(extra: str = "", steps: int = 6, train: str = "", name: str = "tiny.toml",
              checkpoint_every: int = 3) -> Path:
        path = tmp_path / name
        path.write_text(f"""
name = "tiny"
seed = 3

[data]
use = "text-file"
path = "{corpus.name}"

[model]
n_layers = 2
d_model = 32
n_heads = 4
block_size = 16

[train]
max_steps = {steps}
batch_size = 4
warmup_steps = 2
eval_every = 3
eval_steps = 2
checkpoint_every = {checkpoint_every}
log_every = 2
sample_tokens = 0
{train}

[tracker]
use = "none"
{extra}
""")
        return path

    return write


@pytest.fixture
def no_host_sync(monkeypatch):
    """Makes every tensor-to-host read raise while ``forbid[0]`` is True."""
    forbid = [False]

    def guard(name):
        real = getattr(torch.Tensor, name)

        def guarded(self, *args, **kwargs):
            if forbid[0]:
                raise AssertionError(f"Tensor.{name} (a host sync) on a step that is not logged")
            return real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, guarded)

    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "numpy"):
        guard(name)
    return forbid
