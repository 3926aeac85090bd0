"""End to end: a tiny manifest with ``[ffn] use = "moe"`` trains through the real CLI."""

import json
import os
import subprocess
import sys

MANIFEST = """
name = "tiny-moe"
seed = 1

[data]
use = "text-file"
path = "text.txt"

[model]
n_layers = 2
d_model = 32
n_heads = 4
block_size = 16

[ffn]
use = "moe"
n_experts = 4
top_k = 2
hidden = 32
router_z_loss_coef = 0.001

[train]
max_steps = 6
batch_size = 4
warmup_steps = 0
eval_every = 6
eval_steps = 2
checkpoint_every = 6
log_every = 2
sample_tokens = 0

[tracker]
use = "none"
"""


def test_a_manifest_with_moe_trains_and_logs_the_aux_loss(tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (tmp_path / "moe.toml").write_text(MANIFEST)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LMLAB_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "offline"}
    command = [sys.executable, "-m", "lmlab", "run", str(tmp_path / "moe.toml"), "--out", str(tmp_path / "runs")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (summary_path,) = (tmp_path / "runs").rglob("summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert summary["plugins"]["ffn"]["name"] == "moe"
    records = [json.loads(line) for line in (summary_path.parent / "metrics.jsonl").read_text().splitlines()]
    aux = [r["aux_loss"] for r in records if "aux_loss" in r]
    # two layers, each 0.01 x a balance loss near 1 (its value for a uniform router) plus a small z-loss
    assert aux and all(0.01 < a < 0.1 for a in aux)
    # The plugin's hook reports router health on the logged steps: balance ≥ 1 (1 = uniform), and
    # the dropped fraction is a fraction.
    logged = [r for r in records if "moe/balance_loss" in r]
    assert [r["step"] for r in logged] == [r["step"] for r in records if "train_loss" in r]
    assert all(r["moe/balance_loss"] >= 0.99 and 0.0 <= r["moe/dropped_fraction"] < 1.0 for r in logged)
