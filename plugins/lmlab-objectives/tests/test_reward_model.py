"""``reward-model``: the Bradley–Terry loss through a scalar head equals a hand computation, and a reward
model trained on the shipped Shakespeare preference set beats chance on its held-out pairs."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmlab_objectives.reward_model import HEAD, RewardModel, score

ROOT = Path(__file__).resolve().parents[3]
PREFERENCES = ROOT / "data" / "shakespeare-prefs"


def objective() -> RewardModel:
    made = RewardModel()
    made.eos_id = None
    return made


def test_the_loss_is_bradley_terry_on_the_heads_scores_at_each_answers_last_token(tiny_lm, pair_windows):
    objective_ = objective()
    model = tiny_lm(objective=objective_)
    batch = objective_.make_batch_from(pair_windows)
    loss = objective_.forward_loss(model, batch)
    with torch.no_grad():
        hidden = model(batch.input_ids, hidden=True)
        head = model.heads[HEAD]
        r = [float(head(hidden[row, batch.last[row]])) for row in range(4)]
    expected = sum(math.log1p(math.exp(-(r[k] - r[2 + k]))) for k in range(2)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    # the last real tokens: "1 2 3" → 2, "6 7 8" → 2, "1 2 4 5" → 3, "6 9" → 1
    assert batch.last.tolist() == [2, 2, 3, 1]
    assert torch.allclose(score(model, batch.input_ids, batch.last), torch.tensor(r), atol=1e-6)
    accuracy = objective_.take_reports()["accuracy"]
    assert float(accuracy[0]) / accuracy[1] == sum(r[k] > r[2 + k] for k in range(2)) / 2


def test_a_fresh_head_starts_at_zero_bias_and_training_separates_the_pair(tiny_lm, pair_windows):
    objective_ = objective()
    model = tiny_lm(objective=objective_)
    batch = objective_.make_batch_from(pair_windows)
    assert float(model.heads[HEAD].bias.detach().abs().max()) == 0.0
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(30):
        optimizer.zero_grad()
        objective_.forward_loss(model, batch).backward()
        optimizer.step()
    with torch.no_grad():
        r = score(model, batch.input_ids, batch.last)
    assert (r[:2] > r[2:]).all()


def _cli(*args: str, cwd: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "lmlab", *args], capture_output=True, text=True, cwd=cwd,
                            env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_a_reward_model_beats_chance_on_the_held_out_pairs(tmp_path):
    """A small character model pretrained briefly on tinyshakespeare, then trained as a reward model on the
    shipped training pairs, ranks the held-out pairs (other lines of the plays) better than a coin: at
    1727 pairs a coin's accuracy has a standard deviation of 0.012, so 0.54 is more than three of them
    away (this setup measured 0.5715 here)."""
    base = textwrap.dedent(f"""\
        name = "base"
        seed = 1
        [data]
        use = "text-file"
        path = "{ROOT / 'data' / 'tinyshakespeare.txt'}"
        [tokenizer]
        use = "char"
        [model]
        n_layers = 2
        n_heads = 2
        d_model = 64
        block_size = 128
        [optimizer]
        use = "adamw"
        lr = 3e-3
        [train]
        max_steps = 600
        batch_size = 8
        eval_every = 600
        eval_steps = 1
        sample_tokens = 0
        [tracker]
        use = "none"
        """)
    reward = textwrap.dedent(f"""\
        name = "reward"
        seed = 1
        [init]
        from = "{tmp_path / 'runs' / 'base' / 'default'}"
        [data]
        use = "preferences"
        path = "{PREFERENCES / 'train.jsonl.gz'}"
        response_end = "\\n"
        val_fraction = 0.02
        [objective]
        use = "reward-model"
        [optimizer]
        use = "adamw"
        lr = 1e-3
        [train]
        max_steps = 400
        batch_size = 16
        eval_every = 400
        eval_steps = 1
        sample_tokens = 0
        [tracker]
        use = "none"
        """)
    (tmp_path / "base.toml").write_text(base)
    (tmp_path / "reward.toml").write_text(reward)
    _cli("run", "base.toml", "--out", "runs/base", cwd=tmp_path)
    _cli("run", "reward.toml", "--out", "runs/reward", cwd=tmp_path)
    _cli("eval", "runs/reward/default", "--data", str(PREFERENCES / "heldout.jsonl.gz"), "--out", "scores.json",
         cwd=tmp_path)
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert scores["records"] == 1727
    assert scores["val_accuracy"] > 0.54, scores
