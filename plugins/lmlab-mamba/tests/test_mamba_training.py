"""End to end through the real CLI: a manifest with position ``none`` and attention ``mamba`` trains,
and ``lmlab generate`` continues a prompt from the run, past block_size (the recurrence has no limit)."""

import json
import os
import subprocess
import sys

MANIFEST = """
name = "tiny-mamba"
seed = 1

[data]
use = "text-file"
path = "text.txt"

[model]
n_layers = 2
d_model = 32
n_heads = 4
block_size = 16
norm = "rmsnorm"

[position]
use = "none"

[attention]
use = "mamba"
d_state = 8

[optimizer]
use = "adamw"
lr = 3e-3

[train]
max_steps = 30
batch_size = 8
warmup_steps = 0
eval_every = 30
eval_steps = 2
checkpoint_every = 30
log_every = 5
sample_tokens = 0

[decoding]
use = "greedy"

[tracker]
use = "none"
"""


def lmlab(*args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMLAB_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "offline"}
    return subprocess.run([sys.executable, "-m", "lmlab", *args], capture_output=True, text=True, env=env, timeout=300)


def test_a_mamba_manifest_trains_and_generates_beyond_block_size(tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (tmp_path / "mamba.toml").write_text(MANIFEST)
    result = lmlab("run", str(tmp_path / "mamba.toml"), "--out", str(tmp_path / "runs"), tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    (summary_path,) = (tmp_path / "runs").rglob("summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["plugins"]["attention"]["name"] == "mamba"
    losses = [r["train_loss"] for r in map(json.loads, (summary_path.parent / "metrics.jsonl").read_text().splitlines())
              if "train_loss" in r]
    assert losses[-1] < losses[0] - 0.5  # it learns: the text has 28 characters, ln 28 ≈ 3.3 at the start

    result = lmlab("generate", str(summary_path.parent), "--prompt", "the quick", "--max-new-tokens", "40",
                   tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout.rstrip("\n")
    assert text.startswith("the quick") and len(text) == len("the quick") + 40  # 49 > block_size 16
